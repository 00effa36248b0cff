"""``celery singleflight``: see and operate the keys of an app from the command line.

Installed as a Celery command plugin (entry point group ``celery.commands``), so it runs with
the app's own configuration::

    celery -A proj singleflight ls [--prefix P] [--json]       the held keys, one row per run
    celery -A proj singleflight show KEY [--json]              everything known about one key
    celery -A proj singleflight show --task NAME ARGS...        the same, by the task's arguments
    celery -A proj singleflight watch KEY [--slot N | --holder ID] [--json] [--timeout S]
                                                                follow a run live until it ends
    celery -A proj singleflight release KEY [--slot N | --holder ID] [--force] [--json]
                                                                free a key whoever holds it
    celery -A proj singleflight pause KEY [--for S]             no run takes KEY; runs park in order
    celery -A proj singleflight resume KEY                      end the pause; parked runs go on
    celery -A proj singleflight limit KEY [--concurrency N] [--rate R] | --clear
                                                                override KEY's limits until cleared
    celery -A proj singleflight metrics [--port 9808] [--dir D]  serve Prometheus metrics

KEY is the rendered key as ``ls`` prints it: ``job:a`` for ``lock_key="job:<name>"`` called with
``name="a"`` (a string that is not a plain name keeps its JSON quotes: ``'job:"a b"'``). With
``--task NAME``, ``show``, ``watch`` and ``release`` take the task's arguments instead, bound as
the task binds them: each word is read as JSON when it parses (``42``, ``'"42"'``, ``'[1,2]'``),
else as a string, and ``param=value`` passes ``param`` by name
(``celery -A proj singleflight show --task proj.sync_account 42``).

A key of a task with ``max_concurrency=N`` > 1 has one lease per slot (0 to N-1). ``ls`` lists
every held slot as its own row (with a SLOT column when a row's slot is not 0), ``show`` prints
every held slot of the key, and ``watch`` and ``release`` act on one run: the only one held, or
the one chosen with ``--slot N`` or ``--holder TASK_ID``. With several slots held and neither
option, they refuse (exit 6) and list the held slots rather than pick one. The slots read are
those the app's tasks can have (their largest ``max_concurrency``), in one round trip.

``watch`` draws a live progress bar when stdout is a terminal and ``rich`` is installed
(the package's ``cli`` extra), and prints one line per event otherwise; with
``--json`` it prints one JSON object per event (JSON lines), the last one of kind ``end``.

Exit codes:

====  =====================================================================================
0     success: ``ls`` listed (even nothing), ``show`` found the key held, ``watch`` saw the
      run end with outcome ``succeeded``, ``release`` released the key
1     the key is not held: unknown, or its last run ended (``show`` still prints an ended
      run), ``watch`` of a key not held when it starts, ``release`` of a free key (or of a
      key that changed hands before the confirmation), or ``release`` declined ("aborted")
2     configuration error (e.g. no Redis URL), with the message; click's usage errors
      (a missing argument, an unknown option) exit 2 as well
3     Redis unreachable or answering with an error (one line on stderr, no traceback)
4     ``watch``: the run ended with another outcome than ``succeeded`` (failed, revoked,
      lost, force-released, expired, ...)
5     ``watch``: ``--timeout`` passed before the run ended
6     ``watch`` or ``release`` without ``--slot`` or ``--holder`` on a key with several held
      slots (a ``max_concurrency`` > 1 key): nothing is done, the held slots are listed
130   interrupted (Ctrl-C)
====  =====================================================================================
"""

from __future__ import annotations

from .commands import singleflight
from .controls import limit_command, pause_command, resume_command
from .format import (
    duration,
    event_line,
    holder_text,
    progress_text,
    status_lines,
    status_table,
    time_lines,
    when,
)
from .metrics import metrics_command
from .plumbing import (
    EXIT_AMBIGUOUS,
    EXIT_CONFIG,
    EXIT_ENDED_OTHERWISE,
    EXIT_NOT_HELD,
    EXIT_OK,
    EXIT_REDIS,
    EXIT_TIMEOUT,
)

singleflight.add_command(pause_command)
singleflight.add_command(resume_command)
singleflight.add_command(limit_command)
singleflight.add_command(metrics_command)

__all__ = [
    "EXIT_AMBIGUOUS",
    "EXIT_CONFIG",
    "EXIT_ENDED_OTHERWISE",
    "EXIT_NOT_HELD",
    "EXIT_OK",
    "EXIT_REDIS",
    "EXIT_TIMEOUT",
    "duration",
    "event_line",
    "holder_text",
    "progress_text",
    "singleflight",
    "status_lines",
    "status_table",
    "time_lines",
    "when",
]
