"""The demo's Celery app: three everyday jobs, each guarded by a lease on its own key.

Redis comes from ``DEMO_REDIS_URL`` (the demo starts an embedded one): broker db 0, results
db 1, leases db 2.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_singleflight import SingleFlightTask

REDIS = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379")

app = Celery("proj", broker=f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    singleflight_redis_url=f"{REDIS}/2",
    singleflight_namespace="demo",
    singleflight_ttl=10,  # a crashed worker frees a key in 10 s; the heartbeat renews every 3.3 s
    broker_connection_retry_on_startup=True,
)


@app.task(bind=True, base=SingleFlightTask, lock_key="sync:<account_id>", on_duplicate="skip")
def sync_account(self, account_id, pages=4):
    """A double-clicked "sync now" button: the second click is skipped, and says why."""
    for _ in range(pages):
        time.sleep(0.25)
        self.lease.check()  # raises LeaseLost if another run took the key over
    return {"account": account_id, "pages": pages, "fence": self.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="report:<tenant>", on_duplicate="retry", max_wait=30)
def build_report(self, tenant):
    """A report that must not be built twice at once: the duplicate waits its turn and runs."""
    time.sleep(1.0)
    return {"tenant": tenant, "fence": self.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="invoice:<invoice.id>", on_duplicate="raise")
def charge(self, invoice):
    """Charging an invoice twice at once is an error: the duplicate fails loudly."""
    time.sleep(0.5)
    return {"invoice": invoice["id"], "fence": self.lease.fence}
