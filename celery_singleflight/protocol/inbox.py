"""The push to a holder's process: what a script that takes a lease away says at once.

A run's record names its host and pid; a script that marks the run superseded (``COALESCE`` in
``supersede`` mode) or frees it under its holder (``FORCE_RELEASE``) publishes one message on
that process's *inbox* channel, in the same atomic step. Each process subscribes to its own
channel once (one connection, :mod:`..run.inbox`), so a holder learns within milliseconds, not
at its next renewal. The push is the fast path only: a message sent while nobody listens is
lost, and the renewal (every ``lock_ttl / 3``) still finds the same news in the record.

A message is ``<run key>\\x1f<token>\\x1f<kind>\\x1f<fields...>``: the run key and the token name
the lease exactly (a pid reused by a new process never matches a lease it does not hold).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout, Part

__all__ = ["INBOX", "INBOX_CONSTANTS", "RELEASED", "Told", "inbox_channel"]

INBOX = Part("inbox", "pub/sub channel, one per process: `…:<host>:<pid>`", "none (a channel)",
             "a holder's process hears at once what its next renewal would find (a newer run took over,"
             " an operator freed the key)",
             index=True)

#: a message's kind: an operator force-released the lease (field: who); each feature that
#: pushes declares its own kind beside its script (``supersede``: :mod:`.newest`)
RELEASED = "released"
#: the constants of every script that pushes
INBOX_CONSTANTS: dict[str, int | str] = {"INBOX": INBOX.name, "TOLD_RELEASED": RELEASED}


def inbox_channel(layout: Layout, host: str, pid: int) -> str:
    """The inbox channel of the process ``pid`` on ``host`` for ``layout``'s namespace."""
    return f"{layout.index(INBOX)}:{host}:{pid}"


@dataclass(frozen=True)
class Told:
    """One message of an inbox: the lease it is about, what happened, and its fields."""

    run_key: str
    token: str
    kind: str
    fields: tuple[str, ...]

    @classmethod
    def decode(cls, data: bytes | str) -> Told | None:
        """The message, or None if it is not one (a foreign publisher)."""
        raw = data.decode() if isinstance(data, bytes) else data
        parts = raw.split("\x1f")
        if len(parts) < 3:
            return None
        return cls(parts[0], parts[1], parts[2], tuple(parts[3:]))

    def field(self, index: int) -> str:
        return self.fields[index] if index < len(self.fields) else ""

    def ms(self, index: int) -> float | None:
        """Field ``index`` as epoch seconds (it is stored in milliseconds), or None."""
        value = self.field(index)
        return int(value) / 1000.0 if value.isdigit() else None
