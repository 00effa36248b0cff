"""Start a report from a request; read its status by key, as JSON or live."""

import json

from celery.result import AsyncResult
from celery_progress.backend import Progress
from django.http import JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET, require_POST

import celery_singleflight as sf
from celery_singleflight import states

from .tasks import build_report


# --8<-- [start:start]
@require_POST
def start(request, tenant):
    result = build_report.delay(tenant)
    return JsonResponse({
        "task_id": result.id,
        "key": build_report.render_key(tenant),
        "progress_url": f"/progress/{result.id}/",  # what a celery-progress bar polls
    }, status=202)
# --8<-- [end:start]


# --8<-- [start:status]
@require_GET
def status(request, tenant):
    st = build_report.status(tenant)  # the key of build_report(tenant): who holds it, how far
    return JsonResponse({"status": None if st is None else st.as_dict()})
# --8<-- [end:status]


# --8<-- [start:events]
@require_GET
def events(request, tenant):
    """Server-sent events: each update of the run on the tenant's key, until it ends."""
    key = build_report.render_key(tenant)

    def stream():
        for event in sf.watch(build_report.app, key, timeout=60):
            yield f"event: {event.kind}\ndata: {json.dumps(event.as_dict())}\n\n"

    return StreamingHttpResponse(stream(), content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
# --8<-- [end:events]


# --8<-- [start:progress]
@require_GET
def progress(request, task_id):
    """celery-progress's answer for a task, also while it waits as a ``queue`` or ``join``
    duplicate: celery-progress alone reports those states as unknown, and its bar stops."""
    result = AsyncResult(task_id)
    waiting = states.read(result)
    if waiting is not None and waiting.state in (states.QUEUED, states.JOINED):
        return JsonResponse({"state": waiting.state, "complete": False, "success": None, "progress": {
            "pending": True, "current": 0, "total": 0, "percent": 0,
            "description": f"waiting for {waiting.holder} on {waiting.key}",
        }})
    return JsonResponse(Progress(result).get_info())
# --8<-- [end:progress]
