"""A run the library delays waits in Redis as well as in the broker.

``debounce``, ``key_rate_limit`` and the ``retry`` policy delay a run by sending its message
again with a countdown. The worker that fetches a countdown message holds it until its time
(with the Redis broker, unacknowledged); if that worker dies, the message comes back only after
the broker's visibility timeout. So each delay also keeps a copy of the message in Redis
(:mod:`..protocol.delayed`), which a worker's sweeper sends if the countdown message has not
started a grace after its due time, and every copy carries a token by which the one that starts
first claims the run (:func:`claim`): the others are dropped. If Redis cannot keep the copy, the
countdown message goes alone, as before.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, NoReturn

import redis
from celery import states as celery_states
from celery.canvas import Signature
from celery.exceptions import Ignore, Retry
from kombu.utils.json import dumps, loads

from ..protocol.delayed import Claim, ClaimDoneReply, ClaimReply
from ..protocol.store import LeaseStore
from .journal import journal_waiting, new_mark
from .messages import (
    HEADER_ATTEMPT,
    HEADER_DELAYED,
    HEADER_EARLIER,
    HEADER_FIRST_SEEN,
    header,
    message_of,
    send_again,
)
from .owner import worker_instance

__all__ = ["STALE", "claim", "claim_done", "copy_message", "delay_again", "delayed_header", "delayed_token",
           "resend_delayed", "send_copy"]

#: ``apply_async`` options that are not part of a message (objects of the sending process)
_NOT_SENT = frozenset({"connection", "producer", "publisher", "router", "add_to_parent", "eta", "countdown"})

log = logging.getLogger("celery_singleflight.queue")


def delayed_header(token: str, key: str) -> str:
    """The value of :data:`.messages.HEADER_DELAYED` for a message that carries ``token``."""
    return f"{token} {key}"


def delayed_token(request: Any) -> tuple[str, str] | None:
    """``(token, key)`` of a delayed run's message, or None if the library did not delay it."""
    value = header(request, HEADER_DELAYED)
    if not value:
        return None
    token, _, key = str(value).partition(" ")
    return token, key


def delay_again(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float, key: str,
                **headers: Any) -> Any:
    """Send the current run again after ``countdown`` seconds (as :func:`.messages.send_again`),
    keeping a copy in Redis under ``key`` first. Returns the signature sent.

    A run that is itself a delayed copy of ``key`` is delayed again only while its claim stands:
    if a sweeper took it back (its worker seemed gone), another copy runs the run, and this one
    raises ``Ignore`` instead of making a second."""
    token = uuid.uuid4().hex
    request = task.request
    store: LeaseStore = task.store
    message = message_of(task, args, kwargs, **headers)
    mark, own = new_mark(), delayed_token(request)
    claimed = own[0] if own is not None and own[1] == key else ""
    try:
        due = store.delayed.delay(key, str(request.id or ""), token, message, countdown, mark=mark,
                                  claimed=claimed)
    except redis.RedisError as exc:
        log.warning("%s[%s] key=%r: no copy of the delayed run is kept in Redis (%s); its countdown"
                    " message goes alone", task.name, request.id, key, exc)
    else:
        if due is None:
            log.warning("%s[%s] key=%r: another copy of it runs or ran (its claim was taken back); it is not"
                        " delayed again", task.name, request.id, key)
            raise Ignore()
        journal_waiting(task, key, message, "delay", due, token=token, mark=mark)
    headers[HEADER_DELAYED] = delayed_header(token, key)
    return send_again(task, args, kwargs, countdown, **headers)


def copy_message(task: Any, task_id: str, args: Any, kwargs: Any, options: dict[str, Any]) -> str | None:
    """At ``apply_async``: the message of a call about to be sent with a countdown (its
    ``options`` as given), to keep as its copy; None if it cannot be written down."""
    sent = {name: value for name, value in options.items() if name not in _NOT_SENT}
    try:
        sig = task.signature(args, kwargs, {**sent, "task_id": task_id})
        message: str = dumps(dict(sig))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        log.warning("%s[%s]: no copy of the delayed call is kept in Redis (%s)", task.name, task_id, exc)
        return None
    return message


def resend_delayed(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], delay: float, first_seen: float,
                   attempt: int, error: Exception, key: str) -> NoReturn:
    """:func:`.messages.resend` with a copy kept in Redis: the run ends as ``RETRY``."""
    waited = {HEADER_FIRST_SEEN: first_seen, HEADER_ATTEMPT: attempt}
    sig = delay_again(task, args, kwargs, delay, key, **waited)
    raise Retry(exc=error, when=delay, sig=sig)


#: what :func:`claim` answers for a stale copy of a delayed run (another copy runs or ran)
STALE = "stale"


def claim(store: LeaseStore, request: Any, lease_token: str) -> Claim | str | None:
    """A run starts: the :class:`Claim` of its delayed run's copy, :data:`STALE` if it is a stale
    copy (another copy runs or ran: drop it), or None if the library did not delay it. The claim
    names this worker and ``lease_token``, the token the run's lease will have. Redis errors
    propagate (the task's ``on_redis_error`` applies)."""
    found = delayed_token(request)
    if found is None:
        return None
    token, key = found
    task_id = str(request.id or "")
    got = store.delayed.claim(key, task_id, token, worker_instance(request.hostname), lease_token)
    return STALE if got == ClaimReply.STALE else Claim(key, task_id, token)


def claim_done(store: LeaseStore, claim: Claim, before: Any = None) -> bool:
    """The run of ``claim`` started or ended; False if a sweeper took the claim back (its copy
    was sent again: the run must not start). ``before(pipe)``: commands of the same round trip."""
    return store.delayed.done(claim, before) == ClaimDoneReply.DONE


def send_copy(app: Any, store: LeaseStore, key: str, task_id: str, alive: list[str]) -> bool:
    """A sweeper's look at one delayed run due a grace ago: if its message has not started and no
    worker in ``alive`` holds a copy (or a claim of it), send its copy under a new token; unless
    the run has ended meanwhile (its pool process was killed after its claim): then the copy is
    dropped. True if it was sent."""
    token = uuid.uuid4().hex
    found = store.delayed.resend(key, task_id, token, alive)
    if found is None:
        return False
    sig = Signature.from_dict(loads(found.message), app=app)  # type: ignore[no-untyped-call]
    if _ended(app, sig, task_id):
        log.info("key=%r: delayed run %s ended before its copy was sent again; the copy is dropped", key,
                 task_id)
        store.delayed.done(Claim(key, task_id, token))
        return False
    options = sig.options
    headers = {**(options.get("headers") or {}), **found.headers, HEADER_DELAYED: delayed_header(token, key)}
    if found.took:  # a claimant's lease, if it took one, is this copy's to take over
        headers[HEADER_EARLIER] = found.took
    options["headers"] = headers
    if found.took:
        log.warning("key=%r: delayed run %s was claimed by a worker that is gone (or did not start it in"
                    " time); sending its copy again", key, task_id)
    else:
        log.warning("key=%r: delayed run %s had not started after its due time and no worker that holds"
                    " its message is alive; sending its copy", key, task_id)
    sig.apply_async()
    store.delayed.sent(key, task_id)
    return True


def _ended(app: Any, sig: Signature, task_id: str) -> bool:
    """Whether the run's result is ready (it ended); False when its task keeps no result."""
    task = app.tasks.get(sig.task)
    if task is None or task.ignore_result or sig.options.get("ignore_result"):
        return False
    try:
        return str(task.AsyncResult(task_id).state) in celery_states.READY_STATES
    except Exception:  # noqa: BLE001 - any backend's error (none configured): the copy goes
        return False
