"""Three layers against a double payment: a lock key, an idempotency window, a unique constraint.

A payment provider's webhook delivers ``payment.succeeded`` for an invoice, retries a delivery it
thinks was lost, and may send the same effect twice under two delivery ids. ``python
idempotency_example.py`` beside ``celery -A proj worker -I idempotency_example`` sends four
deliveries and shows that one payment row is written.
"""

import os
import sqlite3
import time

from celery_singleflight import SingleFlightTask, fencing

from proj import app
from quickstart_client import wait_until_held

DB = os.environ.get("PAYMENTS_DB", "payments.sqlite3")


def create_table():
    with sqlite3.connect(DB) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS payments ("
            " idem_key TEXT NOT NULL UNIQUE,"  # the guarantee: one row per invoice, whatever ran
            " invoice_id INTEGER NOT NULL, amount INTEGER NOT NULL, delivery_id TEXT NOT NULL)"
        )


# --8<-- [start:task]
@app.task(
    bind=True, base=SingleFlightTask,
    lock_key="invoice:<invoice_id>", on_duplicate="queue",  # one run per invoice at a time, in order
    idempotency_key="delivery:<delivery_id>", idempotency_ttl=24 * 3600,  # a redelivery: run once
)
def record_payment(self, delivery_id, invoice_id, amount):
    time.sleep(0.3)  # call the payment provider's API, etc.
    with sqlite3.connect(DB) as conn:  # commits at the end of the block
        inserted = fencing.insert_once(  # INSERT ... ON CONFLICT (idem_key) DO NOTHING
            conn, "payments",
            {"idem_key": f"invoice:{invoice_id}", "invoice_id": invoice_id, "amount": amount,
             "delivery_id": delivery_id},
            "idem_key",
        )
    return {"delivery": delivery_id, "recorded": inserted}
# --8<-- [end:task]


def main():
    create_table()
    first = record_payment.delay("evt_1", 7, 1000)
    wait_until_held(record_payment.render_key("evt_1", 7, 1000))  # "invoice:7" is being recorded
    again = [record_payment.delay("evt_1", 7, 1000) for _ in range(2)]  # the provider's retries
    other = record_payment.delay("evt_2", 7, 1000)  # the same payment under another delivery id
    answers = [r.get(timeout=30) for r in (first, *again, other)]
    for answer in answers:
        print(answer)
    with sqlite3.connect(DB) as conn:
        rows = conn.execute("SELECT invoice_id, amount, delivery_id FROM payments").fetchall()
    print(rows)  # [(7, 1000, 'evt_1')]: one payment
    return answers, rows


if __name__ == "__main__":
    # run the module as imported, so that its tasks have the names the worker registered
    import idempotency_example

    idempotency_example.main()
