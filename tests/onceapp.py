"""Tasks written for celery-once (its README's examples), with only the import changed.

Redis comes from ``SF_ONCE_REDIS`` (a private server started by tests/test_compat.py): broker
db 0, results db 1. The leases live where celery-once's ``ONCE`` setting says (db 2): no
``singleflight_redis_url`` is set.
"""

import os
from time import sleep

from celery import Celery

from celery_singleflight.compat import QueueOnce  # was: from celery_once import QueueOnce

BASE = os.environ.get("SF_ONCE_REDIS", "redis://127.0.0.1:6379")

celery = Celery("onceapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
celery.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": f"{BASE}/2", "default_timeout": 60 * 60},
}
celery.conf.update(broker_connection_retry_on_startup=True)
app = celery


@celery.task(base=QueueOnce)
def slow_task():
    sleep(1)
    return "Done!"


@celery.task(base=QueueOnce, once={"keys": ["a"]})
def slow_add(a, b):
    sleep(1)
    return a + b


@celery.task(base=QueueOnce, once={"keys": []})
def slow_any(a, b):
    sleep(1)
    return a + b


@celery.task(base=QueueOnce, once={"graceful": True})
def graceful_task(seconds):
    sleep(seconds)
    return "graceful done"


@celery.task(base=QueueOnce, once={"timeout": 60 * 60 * 10})
def long_running_task():
    sleep(0.1)
    return "long done"


@celery.task(bind=True, base=QueueOnce, once={"keys": ["n"]}, max_retries=3)
def flaky(self, n):
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    return self.request.retries


@celery.task(base=QueueOnce, once={"graceful": True})
def notify(*user_ids):
    sleep(1)
    return sorted(user_ids)


@celery.task(base=QueueOnce, once={"graceful": True})
def sync(pk, **options):
    sleep(1)
    return [pk, options]


@celery.task(bind=True, base=QueueOnce, once={"keys": ["n"]}, max_retries=1)
def always_retry(self, n):
    raise self.retry(countdown=1.5)
