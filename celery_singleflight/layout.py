"""Every Redis key of a lock, in one table, and where each one lives.

``<namespace>:{<key>}:<part>``: the braces make the user key the Redis Cluster hash tag, so every
Redis key of one lock shares a slot and one script can touch them all. Braces and ``%`` inside
the user key are percent-escaped, so a key can neither break the tag nor collide with another.

The table (:data:`PARTS`) is the single source for the scripts' callers, the status reader, the
CLI and the "Redis keys" section of the docs (``docs/design.md``, checked by a test).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import KeyTemplateError

__all__ = ["NAMESPACE_PARTS", "PARTS", "KeyLayout", "Part", "keys_table"]


@dataclass(frozen=True)
class Part:
    """One Redis key of a lock: its suffix, type, lifetime and purpose."""

    name: str
    type: str
    ttl: str
    purpose: str
    per_slot: bool = False  # ``run1``, ``run2`` ... for the other slots of a max_concurrency key


#: the Redis keys of one lock (``<ns>:{<key>}:<name>``)
PARTS: tuple[Part, ...] = (
    Part("run", "string: JSON record", "lease TTL + keep while held; keep after the end",
         "the lease (token, deadline, holder, fence) and the status of the slot's current or last run"
         " (state, progress, outcome); `rt`/`by`/`lost` let a re-sent script answer as before",
         per_slot=True),
    Part("history", "stream, `MAXLEN ~ history_length`", "as its record",
         "replayable progress for watchers; only runs that report progress have one", per_slot=True),
    Part("queue", "list of `task id\\|handoff token`", "none (an empty list vanishes)",
         "the `queue` policy's FIFO; an entry leaves only when its run adopts the key; also the copy of a"
         " turned-away redelivery (token `own-…`, at the front)"),
    Part("parked", "hash: task id → message", "none (emptied with the queue)",
         "the re-sendable messages of parked runs"),
    Part("joined", "list of messages", "none (emptied at the holder's end)",
         "the `join` policy: runs waiting for the holder's result"),
    Part("settled", "hash: token → joined messages", "120 s",
         "joined runs handed to a release, kept so that a re-sent release answers the same"),
    Part("enqueued", "string: task id", "`dedup_ttl`", "the enqueue-time dedup marker"),
    Part("coalesce", "hash: `s:<id>` → send stamp, `o:<id>` → messages", "1 day after its last change",
         "the `coalesce` policy: the pending run's send stamp, and the runs it replaced until they are"
         " answered (a caller that died before answering them leaves them to the pending run's start)"),
    Part("order", "hash: `sent`, `next`, `w:<seq>` → message, ...", "1 day after its last change",
         "`ordered=True`: the last sequence number sent, the next one to start, the messages of runs"
         " waiting for their turn, the skipped ones"),
    Part("orderq", "sorted set: sequence numbers waiting", "as `order`",
         "`ordered=True`: which runs wait for their turn, smallest first"),
    Part("done", "string: JSON `{task_id, result}`", "`idempotency_ttl`",
         "the idempotency window (its key is the idempotency key, not the lock key)"),
    Part("rate", "string: `<TAT> <interval> <tolerance>` (µs)", "until the TAT",
         "`key_rate_limit`: the GCRA state; a run may start once it minus the burst tolerance has passed"),
    Part("planned", "sorted set: task id:retries → planned start (µs)", "60 s after the last planned start",
         "`key_rate_limit`: the cells granted, so a re-sent run (or a replayed script) gets its own again"),
    Part("debounce", "hash: leader, first, last, due, count, payload, `c:<task id>`",
         "until due + 10 min", "`debounce`: the open burst of calls (its key is the debounce key)"),
    Part("debounced", "hash: the last closed burst, with `ran`", "10 min",
         "`debounce`: who ran the last burst, for replays and late messages of its calls"),
)

#: keys of a whole namespace (``<ns>:<name>``), outside any lock's hash slot
NAMESPACE_PARTS: tuple[Part, ...] = (
    Part("waiting", "sorted set: key → when to look (ms)", "none (entries leave when nothing waits)",
         "keys with parked or joined runs, for the sweeper"),
    Part("superseding", "sorted set: key → when to revoke (ms)", "none (entries leave with their holder)",
         "keys whose holder was superseded, for the sweeper's revoke after `supersede_grace`"),
    Part("ordering", "sorted set: key → when to look (ms)", "none (entries leave when nothing waits)",
         "`ordered=True` keys with runs waiting for their turn, for the sweeper's gap skip"),
)

def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _unescape(text: str) -> str:
    return text.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def _slotted(part: str, slot: int) -> str:
    return part if slot == 0 else f"{part}{slot}"


@dataclass(frozen=True)
class KeyLayout:
    """Where the Redis keys of one namespace live (see :data:`PARTS`)."""

    namespace: str

    def __post_init__(self) -> None:
        if not self.namespace or re.search(r"[\s{}]", self.namespace):
            raise KeyTemplateError(
                f"singleflight namespace {self.namespace!r} must be non-empty, without spaces or braces"
            )

    def redis_key(self, key: str, part: str) -> str:
        return f"{self.namespace}:{{{_escape(key)}}}:{part}"

    def user_key(self, redis_key: str) -> str | None:
        """The user key of a Redis key of this namespace, or None if it is not ours."""
        prefix = f"{self.namespace}:{{"
        if not redis_key.startswith(prefix):
            return None
        inner, sep, _ = redis_key[len(prefix) :].rpartition("}:")
        return _unescape(inner) if sep else None

    # one method per part, so that a misspelt part is an AttributeError, not a new key

    def run(self, key: str, slot: int = 0) -> str:
        return self.redis_key(key, _slotted("run", slot))

    def history(self, key: str, slot: int = 0) -> str:
        return self.redis_key(key, _slotted("history", slot))

    def queue(self, key: str) -> str:
        return self.redis_key(key, "queue")

    def parked(self, key: str) -> str:
        return self.redis_key(key, "parked")

    def joined(self, key: str) -> str:
        return self.redis_key(key, "joined")

    def settled(self, key: str) -> str:
        return self.redis_key(key, "settled")

    def enqueued(self, key: str) -> str:
        return self.redis_key(key, "enqueued")

    def coalesce(self, key: str) -> str:
        return self.redis_key(key, "coalesce")

    def done(self, idempotency_key: str) -> str:
        return self.redis_key(idempotency_key, "done")

    def rate(self, key: str) -> str:
        return self.redis_key(key, "rate")

    def planned(self, key: str) -> str:
        return self.redis_key(key, "planned")

    def debounce(self, key: str) -> str:
        return self.redis_key(key, "debounce")

    def debounced(self, key: str) -> str:
        return self.redis_key(key, "debounced")

    def waiting(self) -> str:
        return f"{self.namespace}:waiting"

    def superseding(self) -> str:
        return f"{self.namespace}:superseding"

    def ordering(self) -> str:
        return f"{self.namespace}:ordering"

    def order(self, key: str) -> str:
        return self.redis_key(key, "order")

    def orderq(self, key: str) -> str:
        return self.redis_key(key, "orderq")

    def runs(self, key: str, slots: int) -> list[str]:
        """The run records of every slot of ``key``."""
        return [self.run(key, slot) for slot in range(slots)]


def keys_table(namespace: str = "sf", key: str = "sync:42", idempotency_key: str = 'msg:"acme":7') -> str:
    """The Markdown table of :data:`PARTS` and :data:`NAMESPACE_PARTS` for the docs."""
    layout = KeyLayout(namespace)
    lines = ["| key | type | TTL | why |", "| --- | --- | --- | --- |"]
    for part in PARTS:
        name = layout.redis_key(idempotency_key if part.name == "done" else key, part.name)
        if part.per_slot:
            name += f"`, `…:{part.name}1` …"
            lines.append(f"| `{name} | {part.type} | {part.ttl} | {part.purpose} |")
        else:
            lines.append(f"| `{name}` | {part.type} | {part.ttl} | {part.purpose} |")
    for part in NAMESPACE_PARTS:
        lines.append(f"| `{namespace}:{part.name}` | {part.type} | {part.ttl} | {part.purpose} |")
    return "\n".join(lines)
