"""Every script names every key it touches, and only keys of one hash tag: the rule of Redis
Cluster (one slot per call), of Dragonfly's default (undeclared keys refused) and of managed
services that refuse a script without keys (ElastiCache Serverless).

A static reading of the Lua cannot follow a key through the helpers it is passed to, so this
test watches instead: ``MONITOR`` on a private server shows each ``EVALSHA`` with its keys and
then every command its script ran (``[0 lua]``); ``COMMAND GETKEYS`` says which arguments of
each are keys. A full run of every operation of the library (tests/test_isolation.py's, the
time policies and a fenced write) must call every assembled script at least once, so a new
script cannot escape the check. Which keys a script names is the library's, not the server's: this
runs on the suite's server only (not in make test's server matrix).
"""

from __future__ import annotations

import re
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from celery_singleflight import fencing
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.policies import debounce, ratelimit
from celery_singleflight.protocol.lua import Script
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import SCRIPTS, USER_SCRIPTS, store_for
from celery_singleflight.protocol.timing import DueReply
from celery_singleflight.testing import RedisServer
from celery_singleflight.testing.engines import RedisClusterServers

from .conftest import wait_for
from .test_isolation import full_run

NS = "keys-ns"
_ESCAPE = re.compile(r'\\x([0-9a-fA-F]{2})|\\(.)')
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"')
_LINE = re.compile(r"^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$")


def _unquote(text: str) -> bytes:
    """One argument as MONITOR quotes it (C escapes, \\xNN for other bytes)."""
    simple = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}

    def one(match: re.Match[str]) -> str:
        if match.group(1):
            return chr(int(match.group(1), 16))
        return simple.get(match.group(2), match.group(2).encode()).decode("latin-1")

    return _ESCAPE.sub(one, text).encode("latin-1")


@dataclass
class Call:
    """One script call seen by MONITOR: its SHA, its KEYS, and the commands it ran."""

    sha: str
    keys: list[bytes]
    ran: list[list[bytes]] = field(default_factory=list)


class Monitor:
    """``MONITOR`` on a raw connection of its own, read in a thread until ``stop()``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[str] = []
        self.buffer = b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            self.buffer += chunk
            *done, self.buffer = self.buffer.split(b"\r\n")
            self.lines += [line.decode("latin-1") for line in done]

    def stop(self) -> list[str]:
        """Every line up to now: MONITOR shows commands in the order the server ran them, so once
        a marker sent now is seen, so is every command before it."""
        marker = f"monitor-end-{uuid.uuid4().hex}"
        client = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            client.echo(marker)
        finally:
            client.close()
        wait_for(lambda: any(marker in line for line in self.lines), timeout=10)
        self.sock.close()
        self.thread.join(5)
        return [line.removeprefix("+") for line in self.lines if line != "+OK" and marker not in line]


def calls_of(lines: list[str]) -> list[Call]:
    """The script calls among MONITOR's lines, each with the commands its script ran after it."""
    calls: list[Call] = []
    for line in lines:
        parsed = _LINE.match(line)
        assert parsed, line
        source, args = parsed.group(1), [_unquote(t) for t in _TOKEN.findall(parsed.group(2))]
        name = args[0].upper()
        if source == "lua":
            assert calls, f"a script command before any script call: {line}"
            calls[-1].ran.append(args)
        elif name in (b"EVALSHA", b"EVAL", b"EVALSHA_RO", b"EVAL_RO"):
            count = int(args[2])
            sha = args[1].decode() if name.startswith(b"EVALSHA") else "(EVAL)"
            calls.append(Call(sha, args[3:3 + count]))
    return calls


def hash_tag(key: bytes) -> bytes | None:
    """The Cluster hash tag of ``key``: between the first ``{`` and the next ``}``, if not empty."""
    start = key.find(b"{")
    end = key.find(b"}", start + 1)
    return key[start + 1:end] if start >= 0 and end > start + 1 else None


def every_operation(url: str, namespace: str) -> None:
    """Every operation of the library on ``url``: tests/test_isolation.py's full run, the time
    policies, pause and limits, strict send order, coalesce and supersede, the recovery's epoch
    and a fenced write."""
    full_run(url, namespace)
    store = store_for(url, namespace)
    rate = ratelimit.parse_rate("t", "1/s", 1)
    assert rate is not None
    ratelimit.reserve(store, "k", rate, "a:0")
    deb = debounce.Debounce(0.05, None, "last", None)
    debounce.record(store, "k", "a", deb, (1,), {})
    debounce.record(store, "k", "b", deb, (2,), {})
    # the burst's 50 ms of quiet pass: its leader's due then says RUN (a WAIT before it changes nothing)
    wait_for(lambda: store.timing.due("k", "a", "a", "t1").kind == DueReply.RUN, timeout=10, interval=0.01)
    assert store.controls.pause("p:1", 5) is not None and store.controls.resume("p:1")
    store.controls.set_limits("p:1", concurrency=2)
    assert store.controls.clear_limits("p:1") is not None
    seq = store.order.take("o:1", "o-1")
    store.order.gate("o:1", seq, "o-1|1", "{}", 5)
    store.order.advance("o:1", seq, "o-1|1")
    store.order.sweep("o:1", 5)
    assert isinstance(store.acquire("c:1", "tok-c", 5, Holder("c-0")), Acquired)
    assert store.newest.coalesce("c:1", "c-1", "h-1", "{}", "last", "1") == ()
    store.newest.started("c:1", "c-1", 0, "1")
    assert store.epoch.look("life-1")[0] == "life-1"
    client = redis_client(url)
    assert fencing.fenced_set(client, f"report:{{{namespace}}}", "v", 5)
    assert fencing.fenced_get(client, f"report:{{{namespace}}}") is not None


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def watched(request: pytest.FixtureRequest) -> Iterator[tuple[str, RedisServer, list[Call]]]:
    """Private servers that ran every operation under MONITOR, and the script calls they saw.

    On a Cluster of 3 masters, the calls as the library makes them there (a call whose keys span
    two slots would be refused); a standalone call may add a namespace index to a key's keys,
    which saves a round trip where every key lives on one server."""
    if request.param == "standalone":
        with RedisServer() as server:
            monitor = Monitor(server.port)
            every_operation(f"{server.url}/0", "ns-standalone")
            yield request.param, server, calls_of(monitor.stop())
        return
    with RedisClusterServers() as cluster:
        monitors = [Monitor(node.port) for node in cluster.nodes]
        every_operation(cluster.url, "ns-cluster")
        yield request.param, cluster.nodes[0], [c for m in monitors for c in calls_of(m.stop())]


def _shas(scripts: tuple[Script, ...]) -> dict[str, str]:
    return {redis.Redis().register_script(s.source).sha: s.name for s in scripts}  # sha only, no I/O


# its fixture takes about 20 s on the Cluster: every feature's scripts called once through a real worker
# under MONITOR, on a Cluster started for it
def test_every_script_was_called(watched: tuple[str, RedisServer, list[Call]]) -> None:
    """The run above calls every assembled script (else the checks below would miss one)."""
    _, _, calls = watched
    seen = {call.sha for call in calls}
    everything = _shas(SCRIPTS + USER_SCRIPTS)
    assert "(EVAL)" not in seen  # the library sends EVALSHA only
    missing = sorted(name for sha, name in everything.items() if sha not in seen)
    assert missing == [], " ".join(missing)


def test_no_script_is_called_without_keys(watched: tuple[str, RedisServer, list[Call]]) -> None:
    _, _, calls = watched
    names = _shas(SCRIPTS + USER_SCRIPTS)
    assert sorted({names.get(call.sha, call.sha) for call in calls if not call.keys}) == []


def test_every_key_a_script_touches_is_in_its_keys_with_one_hash_tag(
    watched: tuple[str, RedisServer, list[Call]]
) -> None:
    """Each key a script's command touched (COMMAND GETKEYS) is one of the call's KEYS; on the
    Cluster's path, the KEYS of one call share one hash tag, or are one key."""
    shape, server, calls = watched
    admin = server.client()
    names = _shas(SCRIPTS + USER_SCRIPTS)
    keys_of: dict[tuple[bytes, ...], list[bytes]] = {}
    undeclared: set[tuple[str, str]] = set()
    mixed: set[tuple[str, tuple[bytes | None, ...]]] = set()
    for call in calls:
        name = names.get(call.sha, call.sha)
        tags = {hash_tag(key) for key in call.keys}
        if len(call.keys) > 1 and (len(tags) != 1 or None in tags):
            mixed.add((name, tuple(sorted(tags, key=lambda t: t or b""))))
        for command in call.ran:
            found = keys_of.get(tuple(command))
            if found is None:
                try:
                    found = [k if isinstance(k, bytes) else str(k).encode()
                             for k in admin.command_getkeys(*command)]
                except redis.ResponseError:  # a command without keys (TIME, PUBLISH)
                    found = []
                keys_of[tuple(command)] = found
            undeclared |= {(name, key.decode(errors="replace")) for key in found if key not in call.keys}
    assert sorted(undeclared) == []
    if shape == "cluster":
        assert sorted(mixed) == []
