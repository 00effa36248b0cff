"""Tasks written for celery-heimdall (its README's examples), with only the import changed.

Redis comes from ``SF_HEIMDALL_REDIS`` (a private server started by
tests/test_compat_heimdall.py): broker db 0, results db 1, leases db 4.
"""

import os
import time

from celery import Celery

# was: from celery_heimdall import AlreadyQueuedError, HeimdallTask, RateLimit
from celery_singleflight.compat.heimdall import HeimdallTask, RateLimit

BASE = os.environ.get("SF_HEIMDALL_REDIS", "redis://127.0.0.1:6379")

celery = Celery("heimdallapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
celery.conf.update(singleflight_redis_url=f"{BASE}/4", broker_connection_retry_on_startup=True)
app = celery


@celery.task(base=HeimdallTask, heimdall={"unique": True})
def generate_report(customer_id):
    time.sleep(1)
    return f"report {customer_id}"


@celery.task(base=HeimdallTask, heimdall={"unique": True, "unique_raises": True})
def strict_report(customer_id):
    time.sleep(1)
    return f"report {customer_id}"


@celery.task(base=HeimdallTask, heimdall={"unique": True, "key": lambda args, kwargs: "generate_report"})
def one_report(customer_id):
    time.sleep(1)
    return f"report {customer_id}"


@celery.task(base=HeimdallTask, heimdall={"times": 2, "per": 3})
def download(customer_id):
    return time.time()


@celery.task(base=HeimdallTask, heimdall={"rate_limit": RateLimit((1, 2))})
def download_slowly(customer_id):
    return time.time()
