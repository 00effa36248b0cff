"""Where the Redis keys of a lock live, and how each key is declared.

``<namespace>:{<key>}:<part>``: the braces make the user key the Redis Cluster hash tag, so every
Redis key of one lock shares a slot and one script can touch them all. Braces and ``%`` inside
the user key are percent-escaped, so a key can neither break the tag nor collide with another.
A namespace also has a few keys of its own, outside any lock (``<namespace>:<part>``): the
sweeper's indexes.

Each key is one :class:`Part`, declared by the feature that owns it (the run record and its
history here, the queue in :mod:`.handoff`, ...); :data:`.store.PARTS` lists them all, in the
order of the docs' table, and :class:`.store.KeyLayout` has a method per part. The TTL column is
written from :mod:`..constants`, so the table cannot say another number than the code uses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import KeyTemplateError

__all__ = ["HISTORY", "RUN", "Layout", "Part", "duration", "parts_table"]


@dataclass(frozen=True)
class Part:
    """One Redis key: its suffix, type, lifetime and purpose. ``per_slot``: one per slot of a
    ``max_concurrency`` key (``run``, ``run1`` ...); ``index``: a key of the whole namespace."""

    name: str
    type: str
    ttl: str
    purpose: str
    per_slot: bool = False
    index: bool = False


def duration(seconds: float) -> str:
    """``120 s``, ``10 min``, ``1 day``: a retention for the docs' table."""
    if seconds >= 86_400 and seconds % 86_400 == 0:
        days = int(seconds // 86_400)
        return f"{days} day" + ("s" if days > 1 else "")
    if seconds >= 60 and seconds % 60 == 0 and seconds < 3600:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


#: the run record of each slot of a key (see :mod:`.record`)
RUN = Part("run", "string: JSON record", "lease TTL + keep while held; keep after the end",
           "the run record: the lease and the status of the slot's current or last run", per_slot=True)
#: the progress history of each slot's run
HISTORY = Part("history", "stream, `MAXLEN ~ history_length`", "as its record",
               "progress for watchers to replay; only runs that report progress have one", per_slot=True)


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _unescape(text: str) -> str:
    return text.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


class Layout:
    """Where the Redis keys of one namespace live: ``key(part, user_key)``, ``index(part)``."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: str) -> None:
        if not namespace or re.search(r"[\s{}]", namespace):
            raise KeyTemplateError(
                f"singleflight namespace {namespace!r} must be non-empty, without spaces or braces"
            )
        self.namespace = namespace

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.namespace == self.namespace

    def __hash__(self) -> int:
        return hash(self.namespace)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r})"

    def redis_key(self, key: str, part: str) -> str:
        return f"{self.namespace}:{{{_escape(key)}}}:{part}"

    def user_key(self, redis_key: str) -> str | None:
        """The user key of a Redis key of this namespace, or None if it is not ours."""
        prefix = f"{self.namespace}:{{"
        if not redis_key.startswith(prefix):
            return None
        inner, sep, _ = redis_key[len(prefix) :].rpartition("}:")
        return _unescape(inner) if sep else None

    def key(self, part: Part, key: str, slot: int = 0) -> str:
        """The Redis key of ``part`` of the lock ``key`` (slot ``slot`` of a per-slot part)."""
        return self.redis_key(key, part.name if slot == 0 else f"{part.name}{slot}")

    def index(self, part: Part) -> str:
        """The Redis key of a namespace's own ``part``."""
        return f"{self.namespace}:{part.name}"

    def run(self, key: str, slot: int = 0) -> str:
        return self.key(RUN, key, slot)

    def history(self, key: str, slot: int = 0) -> str:
        return self.key(HISTORY, key, slot)

    def runs(self, key: str, slots: int) -> list[str]:
        """The run records of every slot of ``key``."""
        return [self.run(key, slot) for slot in range(slots)]


def parts_table(parts: Sequence[Part], namespace: str = "sf", key: str = "sync:42",
                idempotency_key: str = "msg:acme:7") -> str:
    """The Markdown table of ``parts`` for the docs."""
    layout = Layout(namespace)
    lines = ["| key | type | TTL | why |", "| --- | --- | --- | --- |"]
    for part in parts:
        if part.index:
            name = f"`{layout.index(part)}`"
        else:
            name = f"`{layout.redis_key(idempotency_key if part.name == 'done' else key, part.name)}`"
            if part.per_slot:
                name += f", `…:{part.name}1` …"
        lines.append(f"| {name} | {part.type} | {part.ttl} | {part.purpose} |")
    return "\n".join(lines)
