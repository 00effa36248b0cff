"""The site's Celery app: configured from Django's settings, every name prefixed ``CELERY_``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

app = Celery("mysite")
# CELERY_BROKER_URL -> broker_url, CELERY_SINGLEFLIGHT_TTL -> singleflight_ttl, and so on
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
