"""Progress reported by a task, read by key from another process: status, watch, Celery's meta.

``python progress_example.py`` beside ``celery -A proj worker -I progress_example``.
"""

import time

import celery_singleflight as sf
from celery_singleflight import SingleFlightTask, states

from proj import app
from quickstart_client import wait_until_held


# --8<-- [start:task]
@app.task(bind=True, base=SingleFlightTask, lock_key="import:<tenant>")
def import_rows(self, tenant, rows=20):
    self.progress("loading", current=0, total=rows, message="opening the file")
    for i in range(1, rows + 1):
        time.sleep(0.05)  # read and store one row
        self.progress("loading", current=i, total=rows, message=f"row {i}", table="orders")
    self.progress("finishing", message="building the index")
    time.sleep(0.2)
    return {"tenant": tenant, "rows": rows}
# --8<-- [end:task]


def main():
    result = import_rows.delay("acme")
    # --8<-- [start:read]
    key = import_rows.render_key("acme")  # "import:acme"
    st = wait_until_held(key)  # sf.status(app, key) until a run holds it
    print(st.task_id, st.worker, st.state, st.ttl_left)

    events = []
    for event in sf.watch(app, key, timeout=60):  # replays the run's history, then follows it live
        print(event.kind, event.state, event.current, event.total, event.percent, event.message)
        events.append(event)
    # the last event is kind "end" with the run's outcome as its state: "succeeded"

    st = sf.status(app, key)  # kept for singleflight_status_retention (300 s) after the end
    print(st.held, st.outcome, st.duplicates)  # False succeeded 0
    # --8<-- [end:read]
    value = result.get(timeout=30)
    return events, st, value


def celery_view(result):
    """What a web view can read from Celery's own result backend, by task id."""
    # --8<-- [start:meta]
    meta = states.read(result)  # a SingleFlightMeta in PROGRESS, QUEUED or JOINED; None otherwise
    if meta is not None and meta.state == states.PROGRESS:
        return {"state": meta.progress_state, "percent": meta.percent, "message": meta.message}
    # result.info in PROGRESS also has what celery-progress bars read: current, total, percent,
    # description (the message, else the state) and pending=False
    return {"state": result.state}
    # --8<-- [end:meta]


if __name__ == "__main__":
    # run the module as imported, so that its tasks have the names the worker registered
    import progress_example

    progress_example.main()
