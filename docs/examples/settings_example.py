"""Settings in ``app.conf``, the Django way (``CELERY_SINGLEFLIGHT_*``), and per task.

``python settings_example.py`` prints the options each task resolves to.
"""

import types

from celery import Celery

from celery_singleflight import SingleFlightTask

# --8<-- [start:django]
# settings.py of a Django project
CELERY_BROKER_URL = "redis://localhost:6379/0"
CELERY_SINGLEFLIGHT_REDIS_URL = "redis://localhost:6379/2"
CELERY_SINGLEFLIGHT_TTL = 20  # every guarded task: a 20 s lease, renewed every 6.7 s
CELERY_SINGLEFLIGHT_ON_DUPLICATE = "skip"
# --8<-- [end:django]

settings = types.SimpleNamespace(**{name: value for name, value in globals().items() if name.isupper()})

# --8<-- [start:app]
# proj/celery.py
app = Celery("proj")
app.config_from_object(settings, namespace="CELERY")  # Django: "django.conf:settings"


@app.task(bind=True, base=SingleFlightTask, lock_key="sync:<account_id>")
def sync_account(self, account_id):  # ttl 20, skip: from the settings
    ...


@app.task(bind=True, base=SingleFlightTask, lock_key="charge:<invoice_id>", on_duplicate="raise",
          lock_ttl=60)
def charge(self, invoice_id):  # the task's options win: ttl 60, raise
    ...
# --8<-- [end:app]


def main():
    for task in (sync_account, charge):
        opts = task.options  # resolved and validated once, when the task is bound to the app
        print(task.name, opts.ttl, opts.heartbeat_interval, opts.on_duplicate, opts.redis_url)
    return sync_account.options, charge.options


if __name__ == "__main__":
    main()
