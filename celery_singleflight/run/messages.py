"""A run's own message, re-sent: by the ``retry`` policy, by ``fail_closed``, and parked by
``queue``/``join`` to be sent (or answered) later.

A re-sent message keeps the task id and ``retries`` (waiting for a key must not spend the task's
own ``max_retries``) and carries the library's headers:

- :data:`HEADER_FIRST_SEEN`, :data:`HEADER_ATTEMPT`: when the first attempt was seen and how many
  re-sends followed, to bound the wait (``max_wait``, ``redis_max_wait``);
- :data:`HEADER_HANDOFF`: the token of a parked run, by which it adopts the slot reserved for it;
- :data:`HEADER_EARLIER`: the token of an attempt whose acquire got no reply (Redis unreachable);
  if that attempt did take the key, the re-sent run takes it over instead of waiting for itself;
- :data:`HEADER_SENT`: when ``apply_async`` sent the run (nanoseconds, the sender's clock), put
  on by tasks whose policy needs "newest" (``coalesce``); a re-sent message keeps it;
- :data:`HEADER_SEQ`: the per-key sequence number of an ``ordered=True`` send;
- :data:`HEADER_DELAYED`: ``"<token> <key>"`` on a run the library delayed (a copy waits in
  Redis, :mod:`..protocol.delayed`): the run claims it when it starts, so one copy runs;
- :data:`HEADER_FAIR_WAITED`: when a run parked at its fair gate (epoch seconds): it waited, and
  ``queue_timeout`` bounds that wait;
- :data:`HEADER_PARKED_AT`, :data:`HEADER_HANDED`: when a ``queue`` run parked, and when a
  release sent it on (epoch seconds): its wait and the hand-off's latency, for the metrics;
- :data:`HEADER_REJOIN`: put on a joined run that is sent to run itself (the run it joined was a
  ``hold()``, which has no result), so that if it joins again, its message differs from the one
  the hold's release took (a re-sent JOIN finds that one, and answers as its first run did).
"""

from __future__ import annotations

import json
import time as mod_time
import uuid
from typing import Any, NoReturn

from celery.exceptions import Retry
from kombu.utils.json import dumps

__all__ = [
    "HEADER_ATTEMPT",
    "HEADER_DELAYED",
    "HEADER_EARLIER",
    "HEADER_FAIR_WAITED",
    "HEADER_FIRST_SEEN",
    "HEADER_HANDED",
    "HEADER_HANDOFF",
    "HEADER_PARKED_AT",
    "HEADER_REJOIN",
    "HEADER_SENT",
    "HEADER_SEQ",
    "header",
    "message_of",
    "rejoined",
    "resend",
    "send_again",
    "wait_state",
]

HEADER_FIRST_SEEN = "singleflight_first_seen"
HEADER_ATTEMPT = "singleflight_attempt"
HEADER_HANDOFF = "singleflight_handoff"
HEADER_EARLIER = "singleflight_earlier"
HEADER_SENT = "singleflight_sent"
HEADER_SEQ = "singleflight_seq"
HEADER_REJOIN = "singleflight_rejoin"
HEADER_DELAYED = "singleflight_delayed"
HEADER_FAIR_WAITED = "singleflight_fair_waited"
HEADER_PARKED_AT = "singleflight_parked_at"
HEADER_HANDED = "singleflight_handed"


def header(request: Any, name: str) -> Any:
    """A message header of the current request (Celery puts some on the request itself)."""
    return getattr(request, name, None) or (request.headers or {}).get(name)


def wait_state(request: Any) -> tuple[float, int]:
    """(when the first attempt was seen, how many re-sends so far)."""
    first = header(request, HEADER_FIRST_SEEN)
    attempt = header(request, HEADER_ATTEMPT) or 0
    return (float(first) if first else mod_time.time()), int(attempt)


def message_of(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], request: Any = None,
               **headers: Any) -> str:
    """The current run's message (or ``request``'s), re-sendable (same task id, retries
    unchanged), as JSON."""
    request = task.request if request is None else request
    merged = {**(request.headers or {}), **headers}
    sig = task.signature_from_request(request, args, kwargs, retries=request.retries, headers=merged)
    message: str = dumps(dict(sig))  # type: ignore[no-untyped-call]
    return message


def rejoined(message: str) -> str:
    """A joined run's ``message``, to be sent to run itself: with a :data:`HEADER_REJOIN` of its own."""
    data = json.loads(message)
    options = data.setdefault("options", {})
    options["headers"] = {**(options.get("headers") or {}), HEADER_REJOIN: uuid.uuid4().hex}
    rewritten: str = dumps(data)  # type: ignore[no-untyped-call]
    return rewritten


def send_again(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float,
               **headers: Any) -> Any:
    """Send the current message again after ``countdown`` seconds: the same task id, ``retries``
    unchanged, its headers plus ``headers``. Returns the signature sent."""
    request = task.request
    merged = {**(request.headers or {}), **headers}
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown, retries=request.retries,
                                      headers=merged)
    sig.apply_async()
    return sig


def resend(
    task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], delay: float, first_seen: float, attempt: int,
    error: Exception, **headers: Any,
) -> NoReturn:
    """Re-send the current message after ``delay`` without spending the task's ``max_retries``;
    the run ends as ``RETRY`` (Celery acknowledges the message it came from)."""
    waited = {HEADER_FIRST_SEEN: first_seen, HEADER_ATTEMPT: attempt, **headers}
    sig = send_again(task, args, kwargs, delay, **waited)
    raise Retry(exc=error, when=delay, sig=sig)
