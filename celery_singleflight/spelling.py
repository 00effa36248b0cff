"""Did you mean: the known name a misspelled one is closest to.

The option and setting checks (:mod:`.config.names`) and the transport options of the lease
Redis (:mod:`.connection.targets`) name the right spelling in their error.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["closest"]


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two neighbours) that turn ``a`` into ``b``."""
    previous: list[int] | None = None
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (ca != cb))
            if previous is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous[j - 2] + 1)
        previous, row = row, current
    return row[len(b)]


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is most likely a misspelling of, or None if none is close:
    at most one edit for names up to 7 characters, two for longer ones."""
    lowered = name.lower()
    allowed = 1 if len(name) <= 7 else 2
    best: tuple[int, str] | None = None
    for candidate in sorted(known):
        gap = _distance(lowered, candidate)
        close = 0 < gap <= allowed or (gap == 0 and name != candidate)
        if close and (best is None or gap < best[0]):
            best = (gap, candidate)
    return None if best is None else best[1]
