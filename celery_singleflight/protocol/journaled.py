"""The journal marks of a key: every run that begins to wait on a key in the lease Redis (parked,
joined, pending, waiting for its turn, delayed, at a fair gate) and is journaled by its worker
(:mod:`..run.journal`) leaves its journal line's *mark* beside it, written by the script that
makes it wait (the Lua helper ``journaled``), under the key's hash tag. While Redis has the data
in which the run waited, it has the mark; so a journaled run that no longer waits was handed on
if its mark is there, and lost with Redis's data if it is gone (:mod:`.epoch`).
"""

from __future__ import annotations

from .. import constants
from .layout import Part, duration

__all__ = ["JOURNALED"]

JOURNALED = Part("journaled", "sorted set: journal mark → when its run began to wait (ms)",
                 f"{duration(constants.JOURNAL_KEEP)} after its last change",
                 "the marks of the journaled runs that waited on the key: one that no longer waits and whose"
                 " mark is gone was lost with Redis's data")
