"""What other tools see: Flower (a real process, over HTTP) and a RabbitMQ broker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from types import ModuleType

import pytest
from celery import Celery

from celery_singleflight import LockHeld, is_skipped
from celery_singleflight.testing import RedisServer, WorkerProcess, free_port

from .conftest import HOLD, IN_CI, TESTS, gates_opened_after, let_go, wait_for, worker_env

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

_gates_opened = gates_opened_after("flower", "amqp")


@pytest.fixture
def flower(redis_server: RedisServer) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **worker_env(redis_server), "FLOWER_UNAUTHENTICATED_API": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "sfapp", "flower", f"--port={port}", "--address=127.0.0.1"],
        cwd=str(TESTS), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(f"{base}/healthcheck", timeout=1).read()
            return True
        except OSError:
            return False

    try:
        wait_for(up, timeout=30, interval=0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def flower_state(base: str, task_id: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{base}/api/task/info/{task_id}", timeout=2) as resp:
            return json.load(resp).get("state")  # type: ignore[no-any-return]
    except OSError:
        return None


def test_flower_shows_every_duplicate_as_finished(
    sfapp: ModuleType, start_worker: object, flower: str
) -> None:
    """Given a worker sending events and a real Flower, each duplicate outcome reaches a
    finished state in Flower: raise -> FAILURE, skip -> SUCCESS, retry -> SUCCESS after it ran."""
    q = start_worker(concurrency=3, extra=("-E",)).queue  # type: ignore[operator]
    holder = sfapp.hold_raise.apply_async(("flower", HOLD), queue=q)  # until the duplicates met it
    wait_for(lambda: sfapp.recorder.llen("runs:flower") >= 1, timeout=15)
    raised = sfapp.hold_raise.apply_async(("flower",), queue=q)
    skipped = sfapp.hold_skip.apply_async(("flower",), queue=q)
    retried = sfapp.hold_retry.apply_async(("flower", 0.01), queue=q)
    expected = {holder.id: "SUCCESS", raised.id: "FAILURE", skipped.id: "SUCCESS", retried.id: "SUCCESS"}
    with pytest.raises(LockHeld):
        raised.get(timeout=30)
    skipped.get(timeout=30)
    wait_for(lambda: retried.state == "RETRY", timeout=15)  # it met the holder: it runs once it ended
    let_go(sfapp, "flower")
    for result in (holder, retried):
        result.get(timeout=30)
    for task_id, state in expected.items():
        wait_for(lambda tid=task_id, st=state: flower_state(flower, tid) == st, timeout=15, interval=0.2)


def _rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


def test_rabbitmq_broker_same_outcomes(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    """Given RabbitMQ as the broker (leases and results on Redis), duplicates get the same
    policies. Skips locally without RabbitMQ; in CI it must run."""
    if not _rabbitmq_up():
        if IN_CI:
            pytest.fail("RabbitMQ is not reachable on 127.0.0.1:5672 and CI=true")
        pytest.skip("RabbitMQ is not running on 127.0.0.1:5672")
    vhost_queue = f"sf-test-{os.getpid()}-{int(time.time())}"
    broker = "amqp://guest:guest@127.0.0.1:5672//"
    worker: WorkerProcess = start_worker(  # type: ignore[operator]
        concurrency=2, env={"SF_TEST_BROKER": broker}, extra=("-Q", vhost_queue), wait=False
    )
    client = Celery("client", broker=broker, backend=f"{redis_server.url}/1", set_as_current=False)
    try:
        wait_for(lambda: client.control.ping(destination=[worker.hostname], timeout=0.5), timeout=60)
        # the holder holds until its duplicates met it (HOLD s at most)
        holder = client.send_task("sfapp.hold_raise", ("amqp", HOLD), queue=vhost_queue)
        wait_for(lambda: sfapp.recorder.llen("runs:amqp") >= 1, timeout=15)
        raised = client.send_task("sfapp.hold_raise", ("amqp",), queue=vhost_queue)
        skipped = client.send_task("sfapp.hold_skip", ("amqp",), queue=vhost_queue)
        with pytest.raises(LockHeld):
            raised.get(timeout=30)
        assert is_skipped(skipped.get(timeout=30))
        let_go(sfapp, "amqp")
        assert holder.get(timeout=30)["key"] == "amqp"
        assert sfapp.hold_raise.store.holder_record(sfapp.hold_raise.render_key("amqp")) == {}
    finally:
        with client.connection_for_write() as conn:
            conn.default_channel.queue_delete(vhost_queue)
        client.close()
