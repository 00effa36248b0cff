"""Which server a lease Redis is: its family (Redis, Valkey, ...) and version, and what follows
from them for this library (the oldest one supported, the ACL rule's command names).

Valkey answers ``redis_version:7.2.4`` in ``INFO`` whatever its own version is (for clients that
test it), so the family and version come from ``server_name`` and ``valkey_version`` first; the
``HELLO`` reply (``server``, ``version``), which needs no ACL permission, stands in when ``INFO``
is refused. docs/versioning.md lists the servers tested.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OLDEST", "TESTED", "ServerKind", "server_kind"]

#: the oldest version of each family the library supports (its tests run on Redis 6.2);
#: Valkey's first release (7.2) already is newer than all of them
OLDEST: dict[str, tuple[int, ...]] = {"Redis": (6, 2)}
#: the servers the test suite runs on, as docs/versioning.md names them
TESTED = "Redis 6.2, 7.0 and Valkey 8.0"

#: the families ``INFO`` names in a field of their own (``<name>_version``), else Redis
_FAMILIES = {"valkey": "Valkey", "dragonfly": "Dragonfly", "keydb": "KeyDB", "redis": "Redis"}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


@dataclass(frozen=True)
class ServerKind:
    """A server's family (``Redis``, ``Valkey``, ...) and its version, as numbers."""

    family: str
    version: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.family} {'.'.join(map(str, self.version))}"

    @property
    def oldest(self) -> tuple[int, ...] | None:
        """The oldest version of this family the library supports (None: any)."""
        return OLDEST.get(self.family)

    @property
    def too_old(self) -> bool:
        oldest = self.oldest
        return oldest is not None and self.version < oldest


def server_kind(info: Mapping[str, Any], hello: Mapping[str, Any] | None = None) -> ServerKind | None:
    """The server that answered ``INFO server`` (``info``) or else ``HELLO`` (``hello``); None when
    neither says."""
    name = str(info.get("server_name", "")).lower()
    for key in (name, *_FAMILIES) if name else _FAMILIES:
        found = info.get(f"{key}_version")
        if found:
            return ServerKind(_FAMILIES.get(key, key.title()), _version(str(found)))
    if hello and hello.get("version"):
        server = str(hello.get("server") or "redis").lower()
        return ServerKind(_FAMILIES.get(server, server.title()), _version(str(hello["version"])))
    return None
