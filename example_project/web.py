"""The demo's web app (Flask): buttons and a webhook that dispatch guarded tasks, and their status.

    GET  /                              buttons, and one live progress bar per key
    POST /sync/<policy>/<account_id>    "sync now" (policy: skip, queue or join)
    POST /webhook                       a chat delivery: {"conversation", "delivery_id", "text"}
    GET  /result/<task_id>              a dispatched task's Celery state and result
    GET  /status/<task>/<args...>       a key's status, by the task's arguments (JSON)
    GET  /events[?key=...]              server-sent events: a key's status each time it changes
    GET  /journal                       what actually ran, newest first
    POST /imports/<tenant>/<count>      fair share: a tenant sends ``count`` imports
    GET  /fair                          the imports' fair gate: who runs, who waits (position, ETA)

Run it with ``python example_project/demo.py`` (Redis, a worker and beat included), or on its
own beside your worker: ``DEMO_REDIS_URL=redis://127.0.0.1:6379 flask --app web:web run``.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import proj
import redis
from flask import Flask, Response, abort, jsonify, render_template, request

import celery_singleflight as sf

web = Flask(__name__)

SYNC = {"skip": proj.sync_skip, "queue": proj.sync_queue, "join": proj.sync_join}
ACCOUNTS = (1, 2)
CONVERSATIONS = ("alice", "bob")
_CHANGING = ("age", "ttl_left")  # differ at every read: not a change worth sending


def bars() -> list[tuple[str, str]]:
    """(label, key) of each progress bar on the page."""
    out = [(f"account {account}, {policy}", task.render_key(account))
           for account in ACCOUNTS for policy, task in SYNC.items()]
    # only the conversation is part of the chat's lock key
    out += [(f"chat with {who}", proj.handle_message.render_key(who, None, None)) for who in CONVERSATIONS]
    out.append(("nightly report (beat, every 2 s)", proj.nightly_report.render_key()))
    return out


def status_of(key: str) -> dict[str, Any]:
    st = sf.status(proj.app, key)
    return {"key": key, "status": None if st is None else st.as_dict()}


def _argument(text: str) -> Any:
    """A path segment as the task would get it: JSON when it parses (``42``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@web.get("/")
def index() -> str:
    return render_template("index.html", bars=bars(), accounts=ACCOUNTS, conversations=CONVERSATIONS,
                           policies=list(SYNC))


@web.post("/sync/<policy>/<int:account_id>")
def sync(policy: str, account_id: int) -> Any:
    task = SYNC.get(policy) or abort(404)
    result = task.delay(account_id)
    return jsonify(task_id=result.id, key=task.render_key(account_id)), 202


@web.post("/webhook")
def webhook() -> Any:
    body = request.get_json(silent=True) or {}
    if not all(isinstance(body.get(name), str) for name in ("conversation", "delivery_id", "text")):
        return jsonify(error="expected JSON strings: conversation, delivery_id, text"), 400
    args = (body["conversation"], body["delivery_id"], body["text"])
    result = proj.handle_message.delay(*args)
    return jsonify(task_id=result.id, key=proj.handle_message.render_key(*args)), 202


@web.get("/result/<task_id>")
def result(task_id: str) -> Any:
    # state and meta from one read of the backend: AsyncResult.state then .info are two reads,
    # and a run that ends between them would pair PROGRESS with its return value
    meta = proj.app.AsyncResult(task_id).backend.get_task_meta(task_id)
    state, info = meta["status"], meta["result"]
    body: dict[str, Any] = {"task_id": task_id, "state": state}
    if state == "SUCCESS":
        body["result"] = info
    elif state == "FAILURE":
        body["error"] = f"{type(info).__name__}: {info}"
    elif isinstance(info, dict):
        body["info"] = info  # PROGRESS, QUEUED, JOINED, DEBOUNCED meta
    return jsonify(body)


@web.get("/status/<task>")
@web.get("/status/<task>/<path:args>")
def status(task: str, args: str = "") -> Any:
    found = proj.app.tasks.get(f"proj.{task}")
    if not isinstance(found, sf.SingleFlightTask):
        abort(404)
    values = [_argument(part) for part in args.split("/") if part]
    try:
        key = found.render_key(*values)
    except (TypeError, sf.KeyTemplateError) as exc:
        return jsonify(error=str(exc)), 400
    st = found.status(*values)  # status by the task's arguments
    return jsonify(key=key, status=None if st is None else st.as_dict())


@web.post("/imports/<tenant>/<int:count>")
def imports(tenant: str, count: int) -> Any:
    sent = [proj.import_rows.delay(tenant, batch).id for batch in range(min(count, 100))]
    return jsonify(task_ids=sent), 202


@web.get("/fair")
def fair() -> Any:
    gate = proj.import_rows.fair_status(limit=50)
    return jsonify(None if gate is None else gate.as_dict())


@web.get("/journal")
def journal() -> Any:
    return jsonify([line.decode() for line in proj.journal.lrange(proj.JOURNAL, 0, 19)])


# --8<-- [start:events]
def follow(key: str, changes: queue.Queue[dict[str, Any]], stop: threading.Event) -> None:
    """Put the key's status on ``changes`` each time it changes: woken by ``sf.watch`` at every
    update while a run holds the key, re-read twice a second in between (a new run starting)."""
    last: dict[str, Any] = {}

    def publish() -> bool:
        nonlocal last
        view = status_of(key)
        st = view["status"] or {}
        same = {name: value for name, value in st.items() if name not in _CHANGING}
        if same != last:
            changes.put(view)
            last = same
        return bool(st.get("held"))

    while not stop.is_set():
        try:
            if publish():
                for _event in sf.watch(proj.app, key, timeout=30):
                    if stop.is_set():
                        return
                    publish()
            else:
                stop.wait(0.5)
        except redis.RedisError:
            stop.wait(1.0)  # Redis went away (the demo is stopping); try again


@web.get("/events")
def events() -> Response:
    keys = request.args.getlist("key")[:20] or [key for _, key in bars()]

    def stream() -> Iterator[str]:
        changes: queue.Queue[dict[str, Any]] = queue.Queue()
        stop = threading.Event()
        for key in keys:
            threading.Thread(target=follow, args=(key, changes, stop), daemon=True).start()
        try:
            while True:
                try:
                    view = changes.get(timeout=5)
                except queue.Empty:
                    yield ": keep-alive\n\n"  # also how a closed page is noticed
                    continue
                yield f"data: {json.dumps(view)}\n\n"
        finally:
            stop.set()

    return Response(stream(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
# --8<-- [end:events]
