"""The fault proxy itself, against a private redis-server and real redis-py clients.

Each fault mode is shown to do what the fault tests rely on; above all, that ``drop_reply`` and
``stall_reply`` with ``first_time_only`` make redis-py run a Lua script twice while the caller
sees one answer. redis-py (8.x) re-sends a command on ConnectionError and TimeoutError (including
BusyLoadingError, a ConnectionError: a ``LOADING`` reply) on a new connection, as many times as
its ``Retry`` allows; other error replies (OOM, READONLY, BUSY, NOSCRIPT) are raised at once.
Mind that ``Redis(host=...)`` retries 10 times by default but ``Redis.from_url(...)`` not at all,
so every client here is given its ``Retry``; and that ``incr()`` sends INCRBY.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.retry import Retry

from celery_singleflight.testing import RedisServer

from .conftest import wait_for
from .faultproxy import (
    CUT_AFTER_SEND,
    DROP_COMMAND,
    DROP_REPLY,
    FaultProxy,
    _CommandReader,
    _ReplyReader,
    error_reply,
    script_sha,
    stall_reply,
)

INCR_LUA = "return redis.call('INCR', KEYS[1])"
INCR_SHA = script_sha(INCR_LUA)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    yield started
    started.close()


@pytest.fixture
def direct(server: RedisServer) -> Iterator[redis.Redis]:
    """A client straight to the (private) server, past the proxy; the server starts empty."""
    client = server.client()
    client.flushall()
    client.script_load(INCR_LUA)  # so EVALSHA finds it: no NOSCRIPT round to consume a fault
    yield client
    client.close()


@pytest.fixture
def proxy(server: RedisServer, direct: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy(server.port) as started:
        yield started


@pytest.fixture
def connect(proxy: FaultProxy) -> Iterator[Callable[..., redis.Redis]]:
    """redis-py clients through the proxy (``retries`` re-sends, no backoff); closed afterwards."""
    made: list[redis.Redis] = []

    def make(retries: int = 0, **kwargs: Any) -> redis.Redis:
        client = redis.Redis.from_url(proxy.url(), retry=Retry(NoBackoff(), retries), **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def key() -> str:
    return f"k-{uuid.uuid4().hex[:8]}"


def raw_exchange(proxy: FaultProxy, payload: bytes) -> bytes:
    """Send ``payload`` on a plain socket; everything received until the proxy hangs up."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


# -- the RESP readers ------------------------------------------------------------------------------

REPLIES: list[tuple[bytes, bool]] = [
    (b"+OK\r\n", False),
    (b"-ERR x\r\n", False),
    (b":42\r\n", False),
    (b"$-1\r\n", False),
    (b"$4\r\na\r\nb\r\n", False),  # a bulk string holding CRLF
    (b"*-1\r\n", False),
    (b"*0\r\n", False),
    (b"*2\r\n*2\r\n:1\r\n$1\r\nx\r\n*1\r\n$-1\r\n", False),
    (b"%2\r\n+a\r\n:1\r\n+b\r\n~2\r\n:1\r\n:2\r\n", False),
    (b"|1\r\n+ttl\r\n:3\r\n$1\r\nv\r\n", False),  # an attribute goes with the reply it precedes
    (b"*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n", False),  # ... also inside an aggregate
    (b">3\r\n+invalidate\r\n*1\r\n$1\r\nk\r\n_\r\n", True),
    (b"_\r\n", False),
    (b",3.5\r\n", False),
    (b"#t\r\n", False),
    (b"(12345678901234567890\r\n", False),
    (b"=7\r\ntxt:abc\r\n", False),
    (b"!5\r\nERR x\r\n", False),
]


@pytest.mark.parametrize("step", [1, 3, 1 << 20])
def test_reply_reader_splits_replies_anywhere_in_the_stream(step: int) -> None:
    stream = b"".join(raw for raw, _ in REPLIES)
    reader = _ReplyReader()
    out = []
    for at in range(0, len(stream), step):
        out += reader.feed(stream[at : at + step])
    assert out == REPLIES


def test_command_reader_splits_commands_and_inline_lines() -> None:
    stream = (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n"  # a value holding CRLF
              b"PING\r\n\r\n*0\r\n*1\r\n$4\r\nPING\r\n")  # inline, blank line and *0: no reply
    reader = _CommandReader()
    out = []
    for at in range(len(stream)):
        out += reader.feed(stream[at : at + 1])
    assert [args for _, args in out] == [[b"SET", b"k", b"a\r\nb"], [b"PING"], [], [], [b"PING"]]
    assert b"".join(raw for raw, _ in out) == stream


# -- passthrough -----------------------------------------------------------------------------------


def test_passthrough_pipelines_and_large_values(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    client = connect()
    assert client.set("a", "b") and client.get("a") == b"b"

    pipe = client.pipeline(transaction=False)
    for i in range(1000):
        pipe.set(f"p{i}", i)
    assert pipe.execute() == [True] * 1000
    assert direct.get("p999") == b"999"

    big = bytes(range(256)) * 4096  # 1 MiB, every byte value, CRLFs included
    assert client.set("big", big)
    assert client.get("big") == big
    with client.pipeline(transaction=True) as tx:  # MULTI ... EXEC: QUEUED replies, then one array
        tx.set("big2", big).get("big2").strlen("big")
        assert tx.execute() == [True, big, len(big)]

    assert proxy.commands_seen("SET") == 1 + 1000 + 1 + 1
    assert proxy.commands_seen("MULTI") == proxy.commands_seen("EXEC") == 1
    assert proxy.faults == []


def test_passthrough_register_script_through_noscript(
    proxy: FaultProxy, connect: Callable[..., redis.Redis]
) -> None:
    client = connect()
    lua = f"-- {uuid.uuid4().hex}\nreturn redis.call('INCR', KEYS[1])"
    script = client.register_script(lua)
    assert script(keys=["n"]) == 1  # EVALSHA -> NOSCRIPT, SCRIPT LOAD, EVALSHA again
    assert script(keys=["n"]) == 2
    assert proxy.commands_seen("EVALSHA", script=lua) == 3
    assert proxy.commands_seen("SCRIPT LOAD") == proxy.commands_seen("SCRIPT") == 1
    assert proxy.commands_seen("EVAL") == 0  # no EVAL fallback: SCRIPT LOAD, then EVALSHA again


def test_passthrough_resp3_types(proxy: FaultProxy, connect: Callable[..., redis.Redis]) -> None:
    client = connect(protocol=3)
    client.hset("h", mapping={"a": 1})
    client.sadd("s", "m")
    client.zadd("z", {"m": 1.5})
    assert client.hgetall("h") == {b"a": b"1"}  # %
    assert client.smembers("s") == {b"m"}  # ~
    assert client.zscore("z", "m") == 1.5  # ,
    assert client.get("missing") is None  # _
    assert client.eval("redis.setresp(3); return true", 0) == 1  # #t
    assert client.eval("redis.setresp(3); return {big_number='123456789012345678901'}", 0) \
        == 123456789012345678901  # (
    assert b"id=" in client.execute_command("CLIENT", "INFO")  # =
    assert proxy.commands_seen("HELLO") == 1


def test_a_push_consumes_no_command(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    """A RESP3 invalidation push that arrives while BLPOP waits is passed on as a push: the stall
    rule on BLPOP applies to BLPOP's reply, not to the push."""
    client = connect(protocol=3, single_connection_client=True)
    client.execute_command("CLIENT", "TRACKING", "ON")
    client.get("tracked")
    rule = proxy.add_rule(stall_reply(0.3), name="BLPOP")
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(client.blpop(["list"], timeout=10)))
    waiter.start()
    wait_for(lambda: proxy.commands_seen("BLPOP"))
    direct.set("tracked", "changed")  # -> an invalidation push to the tracking connection
    wait_for(lambda: proxy.pushes == 1)
    assert not rule.event.is_set()
    pushed = time.monotonic()
    direct.rpush("list", "x")
    assert rule.event.wait(5)
    waiter.join(5)
    assert result == [[b"list", b"x"]]
    assert time.monotonic() - pushed >= 0.3
    assert client.get("tracked") == b"changed"


# -- faults ----------------------------------------------------------------------------------------


def test_drop_reply_script_runs_twice_caller_sees_one_answer(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    client = connect(retries=2)
    rule = proxy.add_rule(DROP_REPLY, script=INCR_LUA, first_time_only=True)
    k = key()
    assert client.register_script(INCR_LUA)(keys=[k]) == 2  # the retry's answer
    assert direct.get(k) == b"2"  # ... after the first run, whose reply was dropped
    assert (rule.matched, rule.faulted) == (2, 1)
    assert [(f.action, f.command, f.sha) for f in proxy.faults] == [("drop_reply", "EVALSHA", INCR_SHA)]
    assert proxy.accepted == 2  # the retry came on a new connection


def test_drop_reply_without_retry_raises_after_the_command_ran(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    client = connect(retries=0)
    rule = proxy.add_rule(DROP_REPLY, name="evalsha")
    k = key()
    with pytest.raises(redis.ConnectionError):
        client.evalsha(INCR_SHA, 1, k)
    assert rule.event.is_set()  # set once the reply came back: the script has run
    assert direct.get(k) == b"1"


def test_drop_reply_delivers_the_replies_pipelined_before_it(proxy: FaultProxy, direct: redis.Redis) -> None:
    proxy.add_rule(DROP_REPLY, name="INCR")
    received = raw_exchange(proxy, b"PING\r\n*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\n1\r\n"
                                   b"*2\r\n$4\r\nINCR\r\n$1\r\nn\r\n*2\r\n$3\r\nGET\r\n$1\r\na\r\n")
    assert received == b"+PONG\r\n+OK\r\n"  # then the proxy hung up: no INCR or GET reply
    assert direct.get("n") == b"1"


def test_stall_reply_past_the_socket_timeout_runs_twice(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    client = connect(retries=2, socket_timeout=0.5)
    rule = proxy.add_rule(stall_reply(1.5), script=INCR_LUA, first_time_only=True)
    k = key()
    started = time.monotonic()
    assert client.evalsha(INCR_SHA, 1, k) == 2
    assert 0.5 <= time.monotonic() - started < 1.5  # a timeout and a retry, not the stall
    assert direct.get(k) == b"2"
    assert rule.event.is_set() and rule.faulted == 1


def test_stall_reply_delivers_late(proxy: FaultProxy, connect: Callable[..., redis.Redis]) -> None:
    client = connect()
    client.set("a", "b")
    proxy.add_rule(stall_reply(0.3), name="GET")
    started = time.monotonic()
    assert client.get("a") == b"b"
    assert time.monotonic() - started >= 0.3
    assert proxy.accepted == 1


def test_cut_after_send_the_command_runs(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    rule = proxy.add_rule(CUT_AFTER_SEND, script=INCR_SHA, first_time_only=True)
    k = key()
    # the retry's answer: 2 unless the server ran the retry before the first (it had the first
    # command, then EOF, before the client even saw the cut)
    assert connect(retries=2).evalsha(INCR_SHA, 1, k) in (1, 2)
    wait_for(lambda: direct.get(k) == b"2")
    assert (rule.matched, rule.faulted, proxy.accepted) == (2, 1, 2)


def test_cut_after_send_without_retry_raises(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    rule = proxy.add_rule(CUT_AFTER_SEND, name="INCRBY")  # redis-py's incr() sends INCRBY n 1
    with pytest.raises(redis.ConnectionError):
        connect(retries=0).incr("n")
    assert rule.event.is_set()
    wait_for(lambda: direct.get("n") == b"1")


def test_drop_command_never_reaches_the_server(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    rule = proxy.add_rule(DROP_COMMAND, name="INCRBY")  # redis-py's incr() sends INCRBY n 1
    with pytest.raises(redis.ConnectionError):
        connect(retries=0).incr("n")
    assert rule.event.is_set()
    proxy.remove_rule(rule)
    assert connect(retries=0).get("n") is None  # a later command on a new connection: not run

    proxy.add_rule(DROP_COMMAND, name="INCRBY", first_time_only=True)
    assert connect(retries=1).incr("n") == 1  # refused, retried: run once


@pytest.mark.parametrize(("text", "error"), [
    ("OOM command not allowed when used memory > 'maxmemory'.", OutOfMemoryError),
    ("READONLY You can't write against a read only replica.", ReadOnlyError),
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
     ResponseError),
])
def test_error_reply_is_raised_not_retried(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis,
    text: str, error: type[Exception],
) -> None:
    rule = proxy.add_rule(error_reply(text), name="SET")
    with pytest.raises(error) as raised:
        connect(retries=2).set("a", "b")
    assert type(raised.value) is error
    assert rule.faulted == 1  # no retry
    assert direct.exists("a") == 0  # the server never saw it


def test_error_reply_loading_is_retried_as_a_connection_error(
    proxy: FaultProxy, connect: Callable[..., redis.Redis], direct: redis.Redis
) -> None:
    rule = proxy.add_rule(error_reply("LOADING Redis is loading the dataset in memory"), name="SET")
    with pytest.raises(BusyLoadingError):
        connect(retries=2).set("a", "b")
    assert rule.faulted == 3  # the first try and two retries
    assert proxy.accepted == 3  # each retry on a new connection
    proxy.remove_rule(rule)

    proxy.add_rule(error_reply("LOADING Redis is loading the dataset in memory"), name="SET",
                   first_time_only=True)
    assert connect(retries=1).set("a", "b")
    assert direct.get("a") == b"b"


def test_error_reply_keeps_its_place_among_pipelined_replies(proxy: FaultProxy) -> None:
    proxy.add_rule(error_reply("ERR injected"), name="GET", nth=2)
    received = raw_exchange(proxy, b"PING\r\nGET a\r\nGET a\r\nQUIT\r\n")
    assert received == b"+PONG\r\n$-1\r\n-ERR injected\r\n+OK\r\n"


def test_nth_times_where_and_counters(proxy: FaultProxy, connect: Callable[..., redis.Redis]) -> None:
    client = connect()
    third = proxy.add_rule(error_reply("ERR third"), name="get", nth=3)
    outcomes = []
    for _ in range(5):
        try:
            outcomes.append(client.get("a"))
        except ResponseError as exc:
            outcomes.append(str(exc))
    assert outcomes == [None, None, "third", None, None]
    assert (third.matched, third.faulted) == (5, 1)
    assert proxy.commands_seen("GET") == proxy.commands_seen("get") == 5
    proxy.clear_rules()

    twice = proxy.add_rule(error_reply("ERR twice"), name="SET", times=2)
    only_b = proxy.add_rule(error_reply("ERR b"), name="SET", where=lambda args: args[1] == b"b")
    for expected in ("twice", "twice", None, "b", None):
        name = "b" if expected == "b" else "a"
        try:
            client.set(name, 1)
            assert expected is None
        except ResponseError as exc:
            assert str(exc) == expected
    assert (twice.matched, twice.faulted) == (5, 2)
    assert (only_b.matched, only_b.faulted) == (1, 1)
    assert proxy.commands_seen("SET") == 5
    assert [f.action for f in proxy.faults] == ["error_reply"] * 4


def test_script_selection_by_source_or_sha(proxy: FaultProxy, connect: Callable[..., redis.Redis]) -> None:
    client = connect()
    other = client.register_script("return 7")
    by_source = proxy.add_rule(error_reply("ERR by source"), script=INCR_LUA)
    with pytest.raises(ResponseError, match="by source"):
        client.register_script(INCR_LUA)(keys=["n"])  # EVALSHA <sha of the source>
    with pytest.raises(ResponseError, match="by source"):
        client.eval(INCR_LUA, 1, "n")  # EVAL <source>
    assert other() == 7  # another script goes through
    assert by_source.faulted == 2
    proxy.remove_rule(by_source)

    by_sha = proxy.add_rule(error_reply("ERR by sha"), name="EVALSHA", script=INCR_SHA.upper())
    with pytest.raises(ResponseError, match="by sha"):
        client.evalsha(INCR_SHA, 1, "n")
    assert client.eval(INCR_LUA, 1, "n") == 1  # EVAL is not EVALSHA
    assert by_sha.faulted == 1
    assert proxy.commands_seen(script=INCR_LUA) == 4
    assert proxy.commands_seen("EVAL", script=INCR_SHA) == 2


def test_cut_and_heal(proxy: FaultProxy, connect: Callable[..., redis.Redis]) -> None:
    client = connect()
    assert client.ping()
    proxy.cut()
    assert proxy.is_cut
    with pytest.raises(redis.ConnectionError):
        client.ping()
    proxy.heal()
    assert client.ping()
