"""The run record, declared once: every field, its type, who writes it, who reads it, and why.

One JSON string per slot of a key (``<ns>:{<key>}:run``) holds the lease (``token``,
``deadline``, holder, ``fence``) and the status of the slot's current or last run (state,
progress, outcome), so that taking and releasing a key are one ``SET`` each. The lease runs out
when ``deadline`` (server milliseconds) passes; the key itself lives ``keep`` longer, so the
outcome, the fence and the proof of a release survive for a replay, the status reader and the
next fence. Numbers are stored as strings: ``cjson`` would print a 16-digit fence as
``1.7e+15``.

The core fields are declared here; the fields of one feature in its protocol module
(:class:`~.handoff.HandoffFields`, :class:`~.marks.DuplicateFields`,
:class:`~.newest.NewestFields`). :class:`RunRecord` has them all: it is the table
(:meth:`RunRecord.fields`, :func:`fields_table` for the docs), and the only way Python reads a
record. ``tests/test_protocol.py`` fails when a script writes, or a module reads, a field
that is not declared here, or when a declared writer or reader no longer does.
"""

from __future__ import annotations

from .fields import JSON, MS, NUMBER, TEXT, Field, RecordBase
from .handoff import HandoffFields
from .marks import DuplicateFields
from .newest import NewestFields

__all__ = ["LeaseFields", "RunRecord", "fields_table"]

#: the scripts that write a whole record: a run's own, and a reservation for a parked run (the
#: hand-off helper that RELEASE, RESUME and FORCE_RELEASE share, and ACQUIRE when it hands on)
_RECORD_WRITERS = ("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER")
#: the scripts that read the holder's fields (to pass them on, or to end a dead holder's run)
_HOLDER_READERS = ("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER")
#: the scripts that only check a slot is held (its lease has time left)
_HELD_READERS = ("PARK", "JOIN", "ENQUEUE_MARK", "NOTE_DUPLICATE", "COALESCE")


class LeaseFields(RecordBase):
    """The core fields: the lease, the holder, the run's outcome and progress, the replays.
    ``readers`` are those besides the writers (which read what they change)."""

    __slots__ = ()

    v = Field(TEXT, "the protocol version that wrote the record (absent: 1); a script that cannot"
              " read it answers FOREIGN", writers=_RECORD_WRITERS, readers=())
    token = Field(TEXT, "the lease's owner token (or the parked run's the slot is reserved for); absent"
                  " once released", writers=_RECORD_WRITERS,
                  readers=("RENEW", "PROGRESS", "REVISE_OUTCOME", *_HELD_READERS, "ops.keystatus",
                           "protocol.reads", "protocol.started", "FAIR_TIMEOUT", "protocol.fair",
                           "worker.bootstep"))
    fence = Field(NUMBER, "the run's fencing token, larger than every earlier one of the key",
                  writers=_RECORD_WRITERS,
                  readers=("PROGRESS", "NOTE_DUPLICATE", "ops.keystatus", "protocol.started",
                            "worker.bootstep"))
    since = Field(MS, "when the run took the slot", writers=_RECORD_WRITERS,
                  readers=("ops.keystatus", "protocol.fair"))
    deadline = Field(MS, "when the lease runs out unless renewed; absent once released",
                     writers=("ACQUIRE", "RELEASE", "RENEW", "RESUME", "FORCE_RELEASE", "FAIR_ENTER"),
                     readers=("PROGRESS", *_HELD_READERS, "ops.keystatus",
                              "protocol.reads", "protocol.started", "protocol.fair", "FAIR_TIMEOUT"))
    state = Field(TEXT, "running, the last progress state, handing-off, or the outcome",
                  writers=("ACQUIRE", "RELEASE", "PROGRESS", "REVISE_OUTCOME", "RESUME", "FORCE_RELEASE",
                           "FAIR_ENTER"),
                  readers=("ops.keystatus",))
    outcome = Field(TEXT, "how the run ended: succeeded, failed, revoked, lost, ... (RELEASE asks the"
                    " features' helpers)",
                    writers=("RELEASE", "REVISE_OUTCOME", "FORCE_RELEASE"),
                    readers=("ACQUIRE", "RESUME", "ENQUEUE_MARK", "FAIR_ENTER", "ops.keystatus"))
    ended = Field(MS, "when the run ended", writers=("RELEASE", "FORCE_RELEASE"),
                  readers=("ops.keystatus",))
    updated = Field(MS, "the last progress update or the end",
                    writers=("RELEASE", "PROGRESS", "FORCE_RELEASE"), readers=("ops.keystatus",))
    task_id = Field(TEXT, "the holder's task id (a hold's holder id)", writers=_RECORD_WRITERS,
                    readers=("REVISE_OUTCOME", "PARK", "JOIN", "ENQUEUE_MARK", "COALESCE", "ops.keystatus",
                             "policies.newest", "protocol.started", "worker.bootstep",
                             "worker.sweeper"))
    task_name = Field(TEXT, "the holder's task name (``hold`` for a hold); the holder fields come from"
                      " ``Holder.fields``", writers=("ACQUIRE",),
                      readers=(*_HOLDER_READERS, "ops.keystatus", "policies.newest"))
    worker = Field(TEXT, "the holder's worker (Celery's hostname)", writers=("ACQUIRE",),
                   readers=(*_HOLDER_READERS, "ops.keystatus"))
    host = Field(TEXT, "the holder's host (and its process's inbox)", writers=("ACQUIRE",),
                 readers=("COALESCE", "FORCE_RELEASE", "ops.keystatus", "worker.bootstep"))
    pid = Field(NUMBER, "the holder's process id (and its process's inbox)", writers=("ACQUIRE",),
                readers=("COALESCE", "FORCE_RELEASE", "ops.keystatus", "worker.bootstep"))
    trace = Field(TEXT, "the holder's trace context (a W3C traceparent), which ACQUIRE answers its"
                  " duplicates with, for their spans' links; absent when the run is not traced",
                  writers=("ACQUIRE",), readers=())
    rt = Field(TEXT, "the token of the release that ended the last run: its replay finds it and answers"
               " as before", writers=_RECORD_WRITERS, readers=("worker.bootstep", "worker.sweeper"))
    lost = Field(TEXT, "the fences of recent runs whose lease ran out unreleased: a late release learns"
                 " it lost the key", writers=_RECORD_WRITERS, readers=("protocol.started",))
    prev_task_id = Field(TEXT, "who ran on the slot before this run", writers=_RECORD_WRITERS,
                         readers=("REVISE_OUTCOME", "ops.keystatus", "protocol.started", "worker.bootstep",
                                  "worker.sweeper"))
    prev_outcome = Field(TEXT, "how it ended (running, expired, or its outcome)",
                         writers=("ACQUIRE", "RELEASE", "REVISE_OUTCOME", "RESUME", "FORCE_RELEASE",
                                  "FAIR_ENTER"),
                         readers=("ops.keystatus", "protocol.started"))
    history = Field(TEXT, "``1`` once the run wrote to its history stream",
                    writers=("PROGRESS",), readers=("RELEASE", "RENEW", "FORCE_RELEASE", "NOTE_DUPLICATE"))
    progress = Field(JSON, "the last progress update",
                     writers=("PROGRESS",), readers=("ops.keystatus",))
    pseq = Field(NUMBER, "the last progress update's number: a re-sent one writes nothing",
                 writers=("PROGRESS",), readers=())
    entry = Field(TEXT, "the last update's history entry (a replay's answer)",
                  writers=("PROGRESS",), readers=())
    args = Field(JSON, "the run's arguments, with ``status_include_args``",
                 writers=("PROGRESS",), readers=("ops.keystatus",))


class RunRecord(LeaseFields, HandoffFields, DuplicateFields, NewestFields):
    """A run record with every declared field (see the module docstring)."""

    __slots__ = ()


#: the groups of scripts the fields table names at once
_GROUPS = {"*rec*": _RECORD_WRITERS, "*held*": _HELD_READERS}


def _names(names: tuple[str, ...]) -> str:
    """``names`` for the docs, a whole group shown by its name."""
    shown = list(names)
    for group, members in _GROUPS.items():
        if set(members) <= set(shown):
            shown = [group if name == members[0] else name for name in shown if name not in members[1:]]
    return ", ".join(name if name in _GROUPS else f"`{name}`" for name in shown)


def fields_table() -> str:
    """The Markdown of every field of the run record, for the docs: a legend, then the table."""
    owner = {name: klass.__module__.rsplit(".", 1)[-1] for klass in reversed(RunRecord.__mro__)
             for name, value in vars(klass).items() if isinstance(value, Field)}
    modules: dict[str, list[str]] = {}
    for field in RunRecord.fields():
        if owner[field.name] != "record":
            modules.setdefault(owner[field.name], []).append(f"`{field.name}`")
    declared = "; ".join(f"`{module}`: {', '.join(names)}" for module, names in modules.items())
    legend = "; ".join(f"{group} = {', '.join(members)}" for group, members in _GROUPS.items())
    lines = [f"Declared in `record`, except in {declared}. {legend}. Times (ms) are the Redis server's.", "",
             "| field | type | written by → read by | meaning |", "| --- | --- | --- | --- |"]
    for field in RunRecord.fields():
        access = _names(field.writers) + (f" → {_names(field.readers)}" if field.readers else "")
        lines.append(f"| `{field.name}` | {field.kind.name} | {access} | {field.meaning} |")
    return "\n".join(lines)
