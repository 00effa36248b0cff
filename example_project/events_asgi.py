"""Live progress of one key as server-sent events, from a small ASGI app (no framework needed).

``GET /events?key=sync-queue:42`` streams the run on that key: one ``data:`` line of JSON per
event (``sf.awatch``: its history, then each update as it comes), and the response ends after the
run's final state. Each client is a coroutine awaiting Redis on the server's event loop, never a
thread: one process serves many watchers. Beside the demo (``make demo``)::

    .venv/bin/pip install uvicorn
    .venv/bin/uvicorn --app-dir example_project --factory events_asgi:demo_app --port 8001
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any
from urllib.parse import parse_qs

import celery_singleflight as sf

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# --8<-- [start:app]
def events_app(celery_app: Any, timeout: float = 60.0) -> Callable[..., Awaitable[None]]:
    """An ASGI app streaming the run on ``?key=`` of ``celery_app``'s tasks until it ends."""

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # nothing to do at startup or shutdown
        key = parse_qs(scope["query_string"].decode()).get("key", [""])[0]
        if scope["path"] != "/events" or not key:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"GET /events?key=<lock key>"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        async def stream() -> None:
            async with aclosing(sf.awatch(celery_app, key, timeout=timeout)) as events:
                async for event in events:
                    line = f"data: {json.dumps(event.as_dict())}\n\n"
                    await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})  # after the final state

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        # a client that leaves ends its watch at once, not when the run ends
        tasks = {asyncio.ensure_future(stream()), asyncio.ensure_future(gone())}
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # an error of the stream is the server's to log

    return app
# --8<-- [end:app]


def demo_app() -> Callable[..., Awaitable[None]]:
    """The app for the demo's Celery app (``uvicorn --factory``): imported only when served."""
    from proj import app as demo

    return events_app(demo)
