"""The protocol's scripts by name, as Redis runs them (the fault proxy picks a call by its script)."""

from __future__ import annotations

from celery_singleflight.protocol.store import SCRIPTS

SOURCE: dict[str, str] = {script.name: script.source for script in SCRIPTS}
