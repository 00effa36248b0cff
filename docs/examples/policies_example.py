"""Five of the seven duplicate policies side by side: two sends of one key, the second while the
first runs.

``python policies_example.py`` (beside ``celery -A proj worker -I policies_example``) prints what
each duplicate ended with.
"""

import time

from celery_singleflight import LockHeld, SingleFlightTask, is_skipped, states

from proj import app
from quickstart_client import wait_until_held


# --8<-- [start:tasks]
@app.task(bind=True, base=SingleFlightTask, lock_key="charge:<invoice_id>", on_duplicate="raise")
def charge(self, invoice_id):
    time.sleep(1)
    return f"charged {invoice_id} in {self.request.id}"


@app.task(bind=True, base=SingleFlightTask, lock_key="refresh:<account_id>", on_duplicate="skip")
def refresh(self, account_id):
    time.sleep(1)
    return f"refreshed {account_id} in {self.request.id}"


@app.task(bind=True, base=SingleFlightTask, lock_key="report:<tenant>", on_duplicate="retry", max_wait=30)
def report(self, tenant):
    time.sleep(1)
    return f"report {tenant} in {self.request.id}"


@app.task(bind=True, base=SingleFlightTask, lock_key="chat:<chat_id>", on_duplicate="queue")
def reply(self, chat_id, text):
    time.sleep(1)
    return f"replied {text!r} in {self.request.id}"


@app.task(bind=True, base=SingleFlightTask, lock_key="webhook:<delivery_id>", on_duplicate="join")
def process_webhook(self, delivery_id):
    time.sleep(1)
    return f"processed {delivery_id} in {self.request.id}"
# --8<-- [end:tasks]


def outcome(result):
    """What a duplicate ended with, in words."""
    try:
        value = result.get(timeout=30)
    except LockHeld as exc:
        return f"{result.state}: {type(exc).__name__}: {exc}"
    if is_skipped(value):
        return f"{result.state}: skipped, {value['key']} is held by {value['holder']}"
    return f"{result.state}: {value}"


def main():
    cases = [  # policy, task, the first send's arguments, the duplicate's
        ("raise", charge, (7,), (7,)),
        ("skip", refresh, (42,), (42,)),
        ("retry", report, ("acme",), ("acme",)),
        ("queue", reply, (1, "hello"), (1, "world")),
        ("join", process_webhook, ("d-1",), ("d-1",)),
    ]
    firsts, seconds = {}, {}
    for policy, task, first_args, second_args in cases:
        firsts[policy] = task.delay(*first_args)
        wait_until_held(task.render_key(*first_args))  # the first run holds its key
        seconds[policy] = task.delay(*second_args)  # the duplicate
    time.sleep(0.2)
    # --8<-- [start:waiting]
    for policy, result in seconds.items():
        meta = states.read(result)  # the QUEUED / JOINED meta while it waits, else None
        if meta is not None:
            print(f"{policy}: {meta.state}, waiting for {meta.holder}")
    # --8<-- [end:waiting]
    for policy, result in seconds.items():
        firsts[policy].get(timeout=30)
        print(f"{policy:>5}: the duplicate ended {outcome(result)}")
    return firsts, seconds


if __name__ == "__main__":
    # run the module as imported, so that its tasks have the names the worker registered
    import policies_example

    policies_example.main()
