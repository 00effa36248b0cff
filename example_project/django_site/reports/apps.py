"""The reports app: its tasks are created and checked when Django starts, not at first use."""

from django.apps import AppConfig


class ReportsConfig(AppConfig):
    name = "reports"

    def ready(self):
        # Celery creates a task at its first use; check_app creates them all now, so a misspelled
        # option or CELERY_SINGLEFLIGHT_* setting stops `runserver` instead of a request
        from mysite.celery import app

        from celery_singleflight import check_app

        from . import tasks  # noqa: F401 - defines the tasks

        check_app(app)
