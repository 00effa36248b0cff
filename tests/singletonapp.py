"""Tasks written for celery-singleton (its README's examples), with only the import changed.

Redis comes from ``SF_SINGLETON_REDIS`` (a private server started by
tests/test_compat_singleton.py): broker db 0, results db 1; the leases live where
``singleton_backend_url`` says (db 3): no ``singleflight_redis_url`` is set.
"""

import os
import time

from celery import Celery

# was: from celery_singleton import Singleton
from celery_singleflight.compat.singleton import Singleton

BASE = os.environ.get("SF_SINGLETON_REDIS", "redis://127.0.0.1:6379")

celery_app = Celery("singletonapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
celery_app.conf.update(singleton_backend_url=f"{BASE}/3", broker_connection_retry_on_startup=True)
app = celery_app


@celery_app.task(base=Singleton)
def do_stuff(*args, **kwargs):
    time.sleep(1)
    return "I just woke up"


@celery_app.task(base=Singleton, unique_on=["username"])
def greet(username, greeting):
    time.sleep(1)
    return f"{greeting} {username}"


@celery_app.task(base=Singleton, unique_on="username", raise_on_duplicate=True)
def strict_greet(username, greeting):
    time.sleep(1)
    return f"{greeting} {username}"


@celery_app.task(base=Singleton, lock_expiry=10)
def expiring(n):
    time.sleep(0.1)
    return n
