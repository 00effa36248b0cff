"""The demo's Celery app: everyday jobs of a web app, each guarded by a lease on its own key.

Redis comes from ``DEMO_REDIS_URL`` (the demo starts an embedded one): broker db 0, results db 1,
leases db 2. ``DEMO_BROKER_URL``, when set, is the broker instead (RabbitMQ:
``amqp://guest:guest@127.0.0.1:5672//``); results and leases stay on Redis.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

REDIS = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379")

app = Celery("proj", broker=os.environ.get("DEMO_BROKER_URL") or f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    singleflight_redis_url=f"{REDIS}/2",
    singleflight_namespace="demo",
    singleflight_ttl=10,  # a crashed worker frees a key in 10 s; the heartbeat renews every 3.3 s
    task_default_queue="singleflight-demo",  # never mixes with another app's "celery" queue
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    beat_schedule={
        # every 2 s, for a job that takes 5 s: the ticks that find it running are skipped
        "report-every-2s": {"task": "proj.nightly_report", "schedule": 2.0},
    },
)

# what actually ran, newest first: the web page shows it (demo only; not part of the library)
JOURNAL = "demo:journal"
journal = redis.Redis.from_url(f"{REDIS}/2")


def note(text: str) -> None:
    journal.lpush(JOURNAL, f"{time.strftime('%H:%M:%S')} {text}")
    journal.ltrim(JOURNAL, 0, 99)


# -- "Sync now" buttons: one task per policy, side by side, so a double click shows each -----


def sync_pages(task: SingleFlightTask, account_id: int, pages: int) -> dict:
    task.progress("connecting", message=f"account {account_id}")
    time.sleep(0.3)
    for page in range(1, pages + 1):
        time.sleep(0.4)  # fetch and write one page
        task.progress("loading", current=page, total=pages, message=f"page {page} of {pages}")
    note(f"{task.name.split('.')[-1]}({account_id}) synced {pages} pages, fence {task.lease.fence}")
    return {"account": account_id, "pages": pages, "fence": task.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="sync-skip:<account_id>", on_duplicate="skip")
def sync_skip(self, account_id, pages=8):
    """The second click ends at once without running, and its result says why."""
    return sync_pages(self, account_id, pages)


@app.task(bind=True, base=SingleFlightTask, lock_key="sync-queue:<account_id>", on_duplicate="queue")
def sync_queue(self, account_id, pages=8):
    """The second click waits in a per-key queue in Redis and runs as soon as the first ends."""
    return sync_pages(self, account_id, pages)


@app.task(bind=True, base=SingleFlightTask, lock_key="sync-join:<account_id>", on_duplicate="join")
def sync_join(self, account_id, pages=8):
    """The second click does not run: it gets the first run's result as its own."""
    return sync_pages(self, account_id, pages)


# -- A chat webhook: deliveries repeat, messages of one conversation arrive in bursts --------


# --8<-- [start:chat]
@app.task(bind=True, base=SingleFlightTask, lock_key="chat:<conversation>", on_duplicate="queue",
          idempotency_key="delivery:<delivery_id>", idempotency_ttl=600)
def handle_message(self, conversation, delivery_id, text):
    """One conversation's messages are answered one at a time, in order (``queue`` on the
    conversation); a delivery the provider sends again is answered once (``idempotency_key``:
    a later copy gets the remembered result without running)."""
    self.progress("thinking", message=text[:60])
    time.sleep(1.0)
    note(f"chat {conversation}: answered {text!r} (delivery {delivery_id})")
    return {"conversation": conversation, "delivery": delivery_id, "reply": text.upper()}
# --8<-- [end:chat]


# -- A periodic job slower than its schedule ---------------------------------------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="nightly-report")
def nightly_report(self, steps=5):
    """Sent by ``celery beat`` every 2 s; takes 5 s. Runs never overlap: a tick that finds the
    key held is skipped (beat ticks default to ``skip``) and counted on the run's status."""
    note(f"report started (fence {self.lease.fence})")
    for step in range(1, steps + 1):
        time.sleep(1.0)
        self.progress("building", current=step, total=steps, message=f"section {step}")
    note("report finished")
    return {"sections": steps}


# -- Fair share: two tenants' imports share two slots ------------------------------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="import:<tenant>:<batch>", fair_key="<tenant>",
          fair_concurrency=2)
def import_rows(self, tenant, batch):
    """At most two imports run at once, whoever sent them; when runs wait, each freed slot goes
    to the next tenant in turn, so a tenant that sends 5 behind another's 30 is not starved."""
    time.sleep(0.6)
    note(f"import {tenant}/{batch} done")
    return {"tenant": tenant, "batch": batch}


# -- Two more policies, for the table mode (python example_project/demo.py --table) -----------


@app.task(bind=True, base=SingleFlightTask, lock_key="report:<tenant>", on_duplicate="retry", max_wait=30)
def build_report(self, tenant):
    """A report that must not be built twice at once: the duplicate retries until its turn."""
    time.sleep(1.0)
    return {"tenant": tenant, "fence": self.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="invoice:<invoice.id>", on_duplicate="raise")
def charge(self, invoice):
    """Charging an invoice twice at once is an error: the duplicate fails loudly."""
    time.sleep(0.5)
    return {"invoice": invoice["id"], "fence": self.lease.fence}
