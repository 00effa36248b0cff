"""The example project end to end, as a user runs it: ``python example_project/demo.py`` starts
Redis, a worker, beat and the web app; the tests use it over HTTP and stop it with Ctrl-C."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from celery_singleflight.testing import RedisServer

from .conftest import IN_CI, wait_for
from .demoproc import Demo, alive, get, post, server_sent_events, status_code, wait_result

pytestmark = pytest.mark.worker
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def demo_started() -> Iterator[list[Demo]]:
    """The demos a test starts; any still running at the end is killed (its whole tree)."""
    started: list[Demo] = []
    yield started
    for demo in started:
        if demo.proc.poll() is None:
            demo.kill()


def stop_and_check(demo: Demo) -> None:
    """Ctrl-C stops the demo and everything it started: no process of its tree is left."""
    tree = demo.descendants()
    assert len(tree) >= 3, tree  # at least the worker (and its pool) and beat
    assert demo.interrupt() == 0, demo.output
    assert demo.lines[-1] == "Stopped.", demo.output
    assert wait_for(lambda: not alive(tree), timeout=10), alive(tree)


def journal(base: str) -> list[str]:
    """What ran, oldest first."""
    return list(reversed(get(f"{base}/journal")))


# about 25 s: the demo as a user starts it (embedded Redis, 8 worker processes, beat, the web app), and
# each of its buttons, webhooks and the beat schedule driven through HTTP
def test_demo_end_to_end(demo_started: list[Demo]) -> None:
    demo = Demo("--port", "0")  # 8 worker processes: a free one for each message as it comes
    demo_started.append(demo)
    base = demo.wait_url()
    assert "(embedded)" in demo.output
    page = get(f"{base}/")
    assert "Live keys" in page and 'data-key="sync-queue:1"' in page and 'data-key="nightly-report"' in page

    # Given a double click on each "sync now" button
    sent = {policy: [post(f"{base}/sync/{policy}/1"), post(f"{base}/sync/{policy}/1")]
            for policy in ("skip", "queue", "join")}
    assert sent["queue"][0]["key"] == "sync-queue:1"
    # and a chat provider delivering one message three times, and a burst of three messages
    again = [post(f"{base}/webhook", {"conversation": "alice", "delivery_id": "d-1", "text": "hello"})
             for _ in range(3)]
    burst = []
    for text in ("one", "two", "three"):
        delivery = {"conversation": "bob", "delivery_id": f"b-{text}", "text": text}
        burst.append(post(f"{base}/webhook", delivery))
        # each message reaches the key (runs, or is parked behind the one before) before the next
        # is sent: their order is the order they were sent in
        wait_for(lambda: get(f"{base}/result/{burst[-1]['task_id']}")["state"] != "PENDING", timeout=15)

    # the status of a key, by the task's arguments, while the first sync runs and the second waits
    st = wait_for(lambda: (s := get(f"{base}/status/sync_queue/1")["status"]) and s["queued"] == 1
                  and s["current"] and s, timeout=60)  # a condition: a loaded machine is late
    assert st["held"] and st["state"] == "loading" and st["total"] == 8
    assert st["task_name"] == "proj.sync_queue"
    assert st["task_id"] in {s["task_id"] for s in sent["queue"]} and st["message"].startswith("page ")
    # and live, as server-sent events fed by watch(): the bar advances
    currents = []
    for view in server_sent_events(f"{base}/events?key=sync-queue:1"):
        assert view["key"] == "sync-queue:1"
        currents.append(view["status"]["current"])
        if len(set(currents)) >= 3:
            break
    assert currents == sorted(currents), currents

    # Then each policy handled the double click its own way
    # (either click's task may take the key first: they reach the worker together)
    skip = sorted((wait_result(base, s["task_id"]) for s in sent["skip"]),
                  key=lambda r: "pages" in r["result"])
    assert skip[1]["result"]["pages"] == 8
    assert skip[0]["state"] == "SUCCESS" and skip[0]["result"]["singleflight"] == "skipped"
    queue = [wait_result(base, s["task_id"])["result"] for s in sent["queue"]]
    assert queue[0]["pages"] == queue[1]["pages"] == 8 and queue[0]["fence"] != queue[1]["fence"]  # both ran
    join = [wait_result(base, s["task_id"])["result"] for s in sent["join"]]
    assert join[0] == join[1]  # the second got the first's result
    # the delivery was answered once, all three deliveries got that answer
    answers = [wait_result(base, s["task_id"])["result"] for s in again]
    assert answers == [{"conversation": "alice", "delivery": "d-1", "reply": "HELLO"}] * 3
    for s in burst:
        wait_result(base, s["task_id"])
    ran = journal(base)
    assert sum("alice: answered 'hello'" in line for line in ran) == 1, ran
    bob = [line.split("answered ")[1].split(" ")[0] for line in ran if "chat bob" in line]
    assert bob == ["'one'", "'two'", "'three'"], ran  # in order

    # beat ticks every 2 s for a 5 s job: runs never overlap, the ticks in between are skipped
    wait_for(lambda: sum("report started" in line for line in journal(base)) >= 2, timeout=30)
    reports = [line.split(" ", 2)[2] for line in journal(base) if " report " in line]
    starts = [i for i, what in enumerate(reports) if what.startswith("report started")]
    assert all(reports[i + 1] == "report finished" for i in starts if i + 1 < len(reports)), reports
    report = get(f"{base}/status/nightly_report")["status"]
    assert report["duplicates"] >= 1 or report["previous_outcome"] == "succeeded", report

    # two tenants share the imports' two slots: zeta's 5, sent behind acme's 20, are served in turn
    acme = post(f"{base}/imports/acme/20")["task_ids"]
    gate = wait_for(lambda: (g := get(f"{base}/fair"))["waiting"] and g, timeout=15)
    assert gate["slots"] == 2 and {w["fair_key"] for w in gate["waiting"]} == {"acme"}
    zeta = post(f"{base}/imports/zeta/5")["task_ids"]
    gate = wait_for(lambda: (g := get(f"{base}/fair")) and "zeta" in [w["fair_key"] for w in g["waiting"]]
                    and g, timeout=15)
    waiting = [w["fair_key"] for w in gate["waiting"]]
    assert "zeta" in waiting[:4], waiting  # next to acme's head, not behind its whole backlog
    assert [w["position"] for w in gate["waiting"]] == list(range(1, len(waiting) + 1))
    for task_id in zeta:
        wait_result(base, task_id)
    acme_done = sum(get(f"{base}/result/{task_id}")["state"] == "SUCCESS" for task_id in acme)
    assert acme_done < 15, acme_done  # zeta did not wait for acme's 20
    for task_id in acme:
        wait_result(base, task_id)

    assert status_code(f"{base}/status/nope/1") == 404
    assert status_code(f"{base}/status/sync_skip") == 400  # account_id is missing
    stop_and_check(demo)


def _rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


def test_demo_on_an_existing_redis_and_rabbitmq(demo_started: list[Demo]) -> None:
    """Given URLs, the same demo runs on them (RabbitMQ as broker, Redis for results and
    leases), and on the way out deletes only its own keys."""
    if not _rabbitmq_up():
        if IN_CI:
            pytest.fail("RabbitMQ is not reachable on 127.0.0.1:5672 and CI=true")
        pytest.skip("RabbitMQ is not running on 127.0.0.1:5672")
    with RedisServer() as existing:
        existing.client(2).set("theirs", "kept")
        demo = Demo("--port", "0", "--concurrency", "2", "--broker-url", RABBITMQ,
                    env={"DEMO_REDIS_URL": existing.url})  # one URL by flag, one from the environment
        demo_started.append(demo)
        base = demo.wait_url()
        assert f"Redis: {existing.url}\n" in demo.output + "\n" and f"Broker: {RABBITMQ}" in demo.output
        clicks = [post(f"{base}/sync/join/2") for _ in range(2)]
        first, second = (wait_result(base, c["task_id"]) for c in clicks)
        assert first["result"] == second["result"] and first["result"]["account"] == 2
        st = get(f"{base}/status/sync_join/2")["status"]
        assert st["outcome"] == "succeeded" and st["duplicates"] == 1
        assert existing.client(2).exists("demo:journal")
        stop_and_check(demo)
        leases: redis.Redis = existing.client(2)
        assert leases.get("theirs") == b"kept"
        assert list(leases.scan_iter(match="demo:*")) == []


def test_demo_table() -> None:
    """``demo.py --table``: the non-interactive mode prints every call and how it ended."""
    demo = Demo("--table", "--concurrency", "4")
    try:
        assert demo.proc.wait(90) == 0, demo.output
    finally:
        if demo.proc.poll() is None:
            demo.kill()
    demo._reader.join(5)
    out = demo.output
    assert "sync_skip(1)  # double click" in out and "skipped: sync-skip:1 held by" in out
    assert "joined: got the first run's result" in out
    assert "held back:" in out and "FAILURE" in out
    assert out.count("ran with fence") == 7, out  # skip, 2 x queue, join, 2 x build_report, charge
    assert out.splitlines()[-1] == "Stopped."
