"""The quickstart's Celery app: one guarded task. Run a worker with ``celery -A proj worker``.

Redis comes from ``REDIS_URL`` (default ``redis://localhost:6379``): the broker in database 0,
results in 1, leases in 2.
"""

import os
import time

from celery import Celery

from celery_singleflight import SingleFlightTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

app = Celery("proj", broker=f"{REDIS_URL}/0", backend=f"{REDIS_URL}/1")
app.conf.singleflight_redis_url = f"{REDIS_URL}/2"  # where leases live (default: the broker's Redis)


@app.task(bind=True, base=SingleFlightTask, lock_key="sync:<account_id>", on_duplicate="skip")
def sync_account(self, account_id, pages=5):
    """Sync one account: never twice at once; a double click is skipped, and says why."""
    for page in range(1, pages + 1):
        time.sleep(0.2)  # fetch and store one page
        self.progress("syncing", current=page, total=pages, message=f"page {page} of {pages}")
    return {"account": account_id, "pages": pages, "fence": self.lease.fence}
