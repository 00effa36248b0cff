"""Where the leases live: the URL forms, transport options and client factory (clients.py).

Parsing and the refusals need no server; the built clients are checked for their kind and
connection options (nothing connects until the first command).
"""

from __future__ import annotations

import os
import ssl
from typing import Any

import pytest
import redis
import redis.sentinel

from celery_singleflight.config.options import resolve_options
from celery_singleflight.config.settings import redis_target_for
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.connection.targets import build_client, redacted_url, target_from_settings
from celery_singleflight.errors import ConfigurationError


class FakeTask:
    name = "t"


def _options(**conf: Any) -> Any:
    return resolve_options(FakeTask, {f"singleflight_{k}": v for k, v in conf.items()})


COMMON = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}


@pytest.mark.parametrize(("url", "options", "client", "named"), [
    ("redis+cluster://127.0.0.1:7000/3", {}, None, "database"),
    ("sentinel://127.0.0.1:26379", {}, None, "master_name"),
    ("redis://127.0.0.1:6379/0", {"ssl_ca_certs": "ca.pem"}, None, "rediss://"),
    ("redis+cluster://127.0.0.1:7000", {"ssl_certfile": "c.pem"}, None, "rediss+cluster://"),
    ("redis://127.0.0.1:6379/0", {"master_name": "m"}, None, "sentinel://"),
    ("rediss://127.0.0.1:6379/0", {"ssl_cert_reqs": "maybe"}, None, "ssl_cert_reqs"),
    ("rediss://127.0.0.1:6379/0", {"ssl_ca_cert": "ca.pem"}, None, "ssl_ca_certs"),
    ("redis://127.0.0.1:6379/0", {"socket_timeout": 0}, None, "socket_timeout"),
    ("redis://127.0.0.1:6379/0", {"socket_timeout": 1}, "os.getcwd", "singleflight_redis_client"),
    ("redis://127.0.0.1:6379/0", {}, "no_such_module_x.make", "cannot be imported"),
    ("redis://127.0.0.1:6379/0", {}, 42, "callable"),
    ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379", {"master_name": "m"}, None, "sentinel://host"),
    ("redis+cluster://", {}, None, "host:port"),
])
def test_bad_combinations_name_the_setting(
    url: str, options: dict[str, Any], client: Any, named: str
) -> None:
    with pytest.raises(ConfigurationError, match="singleflight_redis") as raised:
        target_from_settings(url, options, client)
    assert named in str(raised.value)


def test_bad_combination_fails_when_the_options_resolve() -> None:
    with pytest.raises(ConfigurationError, match="master_name"):
        _options(redis_url="sentinel://127.0.0.1:26379")
    with pytest.raises(ConfigurationError, match="singleflight_redis_url"):
        _options(redis_url="memcached://127.0.0.1:11211")


def test_standalone_tls_options_reach_the_connection() -> None:
    target = target_from_settings("rediss://u:pw@127.0.0.1:6390/2", {
        "ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem", "socket_timeout": 1.5,
    })
    client = build_client(target, COMMON)
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    files = (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"])
    assert files == ("/ca.pem", "/c.pem", "/k.pem")
    assert kwargs["socket_timeout"] == 1.5  # the transport option wins over the library's default
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "pw", 2)


def test_sentinel_url_celery_form() -> None:
    target = target_from_settings(
        "sentinel://:secret@127.0.0.1:26379/3;sentinel://127.0.0.1:26380",
        {"master_name": "leases", "sentinel_kwargs": {"password": "sentinel-pw"}},
    )
    client = build_client(target, COMMON)
    pool = client.connection_pool
    assert type(client) is redis.Redis and pool.service_name == "leases"
    assert pool.connection_kwargs["password"] == "secret" and pool.connection_kwargs["db"] == 3
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sentinel-pw"
    assert "secret" not in target.describe() and "***" in target.describe()


def test_cluster_url_startup_nodes() -> None:
    target = target_from_settings("rediss+cluster://u:pw@127.0.0.1:7000,127.0.0.1:7001/0",
                                  {"ssl_ca_certs": "/ca.pem"})
    assert target.cluster and "pw" not in target.describe()
    assert redacted_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    # the client itself connects at once: built against a real cluster in test_cluster.py


def test_client_factory_by_path_and_callable() -> None:
    made: list[redis.Redis] = []

    def make() -> redis.Redis:
        made.append(redis.Redis(port=1))
        return made[-1]

    target = redis_target_for({"singleflight_redis_client": make})
    assert target.url == "" and build_client(target, COMMON) is made[0]
    by_path = target_from_settings("", None, "redis.Redis")
    assert isinstance(build_client(by_path, COMMON), redis.Redis)
    with pytest.raises(ConfigurationError, match="not a Redis client"):
        build_client(target_from_settings("", None, "os.getcwd"), COMMON)
    opts = _options(redis_client=make)
    assert opts.redis.factory is make


def test_one_client_per_target_and_process() -> None:
    plain = redis_client("redis://127.0.0.1:6391/0")
    assert redis_client(target_from_settings("redis://127.0.0.1:6391/0")) is plain  # same settings
    timed = redis_client(target_from_settings("redis://127.0.0.1:6391/0", {"socket_timeout": 1.0}))
    assert timed is not plain and timed.connection_pool.connection_kwargs["socket_timeout"] == 1.0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child builds its own
        os.write(write, b"1" if redis_client("redis://127.0.0.1:6391/0") is not plain else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"



def test_sentinel_with_tls_options_uses_tls_connections_to_the_master() -> None:
    options = {"master_name": "m", "ssl_ca_certs": "/ca.pem"}
    target = target_from_settings("sentinel://127.0.0.1:26379", options)
    pool = build_client(target, COMMON).connection_pool
    assert pool.connection_class is redis.sentinel.SentinelManagedSSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
