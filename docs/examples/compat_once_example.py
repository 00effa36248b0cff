"""Tasks and calls written for celery-once, unchanged but for the import. One call behaves
differently, and says so: a graceful duplicate returns the queued task's ``AsyncResult``
(celery-once returned an empty ``REJECTED`` result).

``python compat_once_example.py`` beside ``celery -A proj worker -I compat_once_example``.
"""

import time

from celery_singleflight.compat import AlreadyQueued, QueueOnce  # was: from celery_once import ...

from proj import app


# --8<-- [start:tasks]
@app.task(base=QueueOnce, once={"graceful": True})
def slow_task():
    time.sleep(1)
    return "Done!"


@app.task(base=QueueOnce, once={"keys": ["a"]})
def slow_add(a, b):
    time.sleep(1)
    return a + b


@app.task(base=QueueOnce, once={"keys": [], "timeout": 60 * 60 * 10})
def long_running_task():
    time.sleep(1)
    return "long done"
# --8<-- [end:tasks]


def main():
    # --8<-- [start:calls]
    first = slow_add.delay(1, 1)
    try:
        slow_add.delay(1, 2)  # the same a=1 is queued or running
    except AlreadyQueued as exc:
        print(f"already queued; try again in {exc.countdown:.0f}s")  # always a number
    other = slow_add.delay(2, 2)  # another key: sent

    done = slow_task.delay()
    again = slow_task.delay()  # graceful: no error; here the queued task's AsyncResult
    assert again.id == done.id
    # --8<-- [end:calls]
    return first, other, done, again


if __name__ == "__main__":
    # run the module as imported, so that its tasks have the names the worker registered
    import compat_once_example

    compat_once_example.main()
