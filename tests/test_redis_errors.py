"""Which Redis errors are an outage ("cannot serve this now") and which stay loud, read off a real
server: the one under test, as each words a script's error differently (make test's server
matrix runs this on Redis 6.2, 7.0 and Valkey 8)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_singleflight.connection.clients import UNAVAILABLE_STATES, is_unavailable
from celery_singleflight.protocol.replies import Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

pytestmark = pytest.mark.server


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def test_out_of_memory_inside_a_lease_script_is_unavailable(server: RedisServer) -> None:
    """A real OOM refusal of a lease script (maxmemory below what is used, noeviction)."""
    client = server.client()
    store = LeaseStore(client, KeyLayout("sf"))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        with pytest.raises(redis.RedisError) as info:
            store.acquire("k", "tok", 5, Holder("t"))
    finally:
        client.config_set("maxmemory", "0")
    assert is_unavailable(info.value), repr(info.value)


def test_a_script_error_and_a_refused_permission_stay_loud(server: RedisServer) -> None:
    client = server.client()
    client.set("not-a-number", "x")
    with pytest.raises(redis.ResponseError) as script_error:
        client.eval("return redis.call('INCR', KEYS[1])", 1, "not-a-number")
    assert not is_unavailable(script_error.value)
    client.execute_command("ACL", "SETUSER", "limited", "reset", "on", ">pw", "~*", "+ping")
    port = client.connection_pool.connection_kwargs["port"]
    limited = redis.Redis(host="127.0.0.1", port=port, username="limited", password="pw")
    with pytest.raises(redis.exceptions.NoPermissionError) as refused:
        limited.get("x")
    assert not is_unavailable(refused.value)


@pytest.mark.parametrize("code", UNAVAILABLE_STATES)
def test_every_server_state_is_unavailable_in_either_wording(code: str) -> None:
    """As redis-py parses the reply of a plain command (the code first), and as Redis 6.2 wraps a
    script's error (``ERR Error running script ... -CODE ...``)."""
    from redis._parsers import BaseParser

    plain = BaseParser.parse_error(f"{code} the server says no")
    wrapped = BaseParser.parse_error(
        f"ERR Error running script (call to f_0123): @user_script:7: @user_script: 7: -{code} says no"
    )
    assert is_unavailable(plain) and is_unavailable(wrapped)


def test_unreachable_is_unavailable() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    with pytest.raises(redis.ConnectionError) as info:
        client.ping()
    assert is_unavailable(info.value)
    assert not is_unavailable(ValueError("not a Redis error"))
    assert not is_unavailable(redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
