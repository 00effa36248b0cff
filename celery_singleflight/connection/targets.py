"""Where the leases live, read from the settings, and how a client for it is built.

Three settings say it (the forms follow Celery's own Redis result backend):

- ``singleflight_redis_url``: ``redis://``, ``rediss://`` (TLS), ``unix://``; Sentinel as
  ``sentinel://[:password@]host:port[/db][;sentinel://host:port...]`` with the master's name in the
  transport options; a Cluster as ``redis+cluster://`` / ``rediss+cluster://host:port[,host:port...]``
  (its startup nodes).
- ``singleflight_redis_transport_options``: ``master_name``, ``sentinel_kwargs`` (the sentinels' own
  password and TLS), the TLS files, timeouts.
- ``singleflight_redis_client``: a callable (or its dotted path) returning a ready client, for
  anything the URL cannot say.

Everything is checked when the options resolve (the worker's start), so a bad combination is a
:class:`~.errors.ConfigurationError` naming the setting, not a failure at the first task.
"""

from __future__ import annotations

import importlib
import json
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ..errors import ConfigurationError
from ..spelling import closest

__all__ = [
    "BLOCKING", "CLUSTER_SCHEMES", "SENTINEL_SCHEME", "STANDALONE_SCHEMES", "TRANSPORT_OPTIONS",
    "ClientClasses", "RedisTarget", "build_client", "is_cluster", "redacted_url", "redis_database",
    "target_from_settings",
]

STANDALONE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "sentinel"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

_TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_TIMEOUT_OPTIONS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")
#: every transport option we read, and what it is for
TRANSPORT_OPTIONS: dict[str, str] = {
    "master_name": "Sentinel: the name of the monitored master (required with sentinel://)",
    "sentinel_kwargs": "Sentinel: connection options for the sentinels themselves (their password, TLS)",
    "ssl_cert_reqs": "TLS: 'required' (default), 'optional' or 'none'",
    "ssl_ca_certs": "TLS: the CA bundle that signed the server's certificate",
    "ssl_certfile": "TLS: this client's certificate (servers with tls-auth-clients)",
    "ssl_keyfile": "TLS: this client's private key",
    "ssl_check_hostname": "TLS: check the server's name against its certificate (default False)",
    "socket_timeout": "seconds to wait for a reply (default 5)",
    "socket_connect_timeout": "seconds to wait for a connection (default 2)",
    "health_check_interval": "seconds idle before a connection is checked with PING (default 30)",
    "max_connections": "the most connections a process opens (default: no limit)",
    "username": "ACL user, when not in the URL",
    "password": "password, when not in the URL",
}

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}

_URL = "singleflight_redis_url"
_OPTIONS = "singleflight_redis_transport_options"
_CLIENT = "singleflight_redis_client"


@dataclass(frozen=True, eq=False)
class RedisTarget:
    """The validated settings for one Redis (or Sentinel group, or Cluster).

    ``cache_key`` identifies it: processes keep one client per target, so two tasks with the same
    settings share a client (and one renewer thread).
    """

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    factory: Callable[[], Any] | None = None
    factory_name: str = ""

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme.lower() if self.url else ""

    @property
    def cache_key(self) -> str:
        if not self.options and self.factory is None:
            return self.url  # the common case, and the same client as for the bare URL
        return json.dumps([self.url, self.factory_name or (id(self.factory) if self.factory else ""),
                           sorted(self.options.items())], default=repr)

    @property
    def cluster(self) -> bool:
        return self.scheme in CLUSTER_SCHEMES

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RedisTarget) and other.cache_key == self.cache_key

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def describe(self) -> str:
        """Fit for a log line: the URL without its passwords, or the client factory's name."""
        if self.factory is not None:
            return f"client from {self.factory_name}"
        return ";".join(redacted_url(part) for part in self.url.split(";"))


def target_from_settings(url: str, options: Any = None, client: Any = None) -> RedisTarget:
    """Check the three settings together and return the target they describe."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"{_OPTIONS} must be a dict, not {options!r}")
    for name in options:
        if name not in TRANSPORT_OPTIONS:
            near = closest(str(name), TRANSPORT_OPTIONS)
            hint = f"did you mean {near!r}?" if near else f"the options are: {', '.join(TRANSPORT_OPTIONS)}"
            raise ConfigurationError(f"{_OPTIONS} has unknown option {name!r}; {hint}")
    if client is not None:
        if options:
            raise ConfigurationError(
                f"{_CLIENT} is set: the client it returns carries its own options,"
                f" so {_OPTIONS} must be unset"
            )
        factory, name = _factory(client)
        return RedisTarget(url=url, factory=factory, factory_name=name)
    scheme = urlsplit(url).scheme.lower()
    tls = [name for name in options if name in _TLS_OPTIONS]
    if scheme in ("redis", "unix", "redis+cluster") and tls:
        secure = {"redis": "rediss://", "unix": "rediss://", "redis+cluster": "rediss+cluster://"}[scheme]
        raise ConfigurationError(
            f"{_OPTIONS} has TLS options ({', '.join(tls)}) but {_URL} is {scheme}://, which is not TLS;"
            f" use {secure}"
        )
    if "ssl_cert_reqs" in options and str(options["ssl_cert_reqs"]).lower() not in _CERT_REQS:
        raise ConfigurationError(
            f"{_OPTIONS}['ssl_cert_reqs'] is {options['ssl_cert_reqs']!r};"
            f" choose one of {', '.join(_CERT_REQS)}"
        )
    for name in _TIMEOUT_OPTIONS:
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            raise ConfigurationError(
                f"{_OPTIONS}[{name!r}] must be a number of seconds above zero, not {value!r}"
            )
    if scheme == SENTINEL_SCHEME:
        _check_sentinel(url, options)
    elif scheme in CLUSTER_SCHEMES:
        _check_cluster(url, options)
    else:
        if "master_name" in options or "sentinel_kwargs" in options:
            raise ConfigurationError(
                f"{_OPTIONS} has master_name/sentinel_kwargs, which only mean something"
                f" with a sentinel:// {_URL}"
            )
    return RedisTarget(url=url, options=dict(options))


def _factory(client: Any) -> tuple[Callable[[], Any], str]:
    if isinstance(client, str):
        module, _, attr = client.replace(":", ".").rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(f"{_CLIENT} {client!r} cannot be imported: {exc}") from exc
        if not callable(found):
            raise ConfigurationError(f"{_CLIENT} {client!r} is not callable")
        return found, client
    if not callable(client):
        raise ConfigurationError(f"{_CLIENT} must be a callable returning a Redis client, or its dotted path,"
                                 f" not {client!r}")
    name = f"{getattr(client, '__module__', '?')}.{getattr(client, '__qualname__', repr(client))}"
    return client, name


def _hosts(url: str, separator: str) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for part in url.split(separator):
        parts = urlsplit(part.strip())
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ConfigurationError(f"{_URL} {url!r}: {exc}") from exc
        if not host:
            raise ConfigurationError(f"{_URL} {url!r}: every node needs host:port")
        found.append((host, port or (26379 if parts.scheme == SENTINEL_SCHEME else 6379)))
    return found


def _check_sentinel(url: str, options: Mapping[str, Any]) -> None:
    if not options.get("master_name"):
        raise ConfigurationError(
            f"{_URL} is a sentinel:// URL, so {_OPTIONS} needs 'master_name' (the name the sentinels monitor)"
        )
    for part in url.split(";"):
        if urlsplit(part.strip()).scheme.lower() != SENTINEL_SCHEME:
            raise ConfigurationError(f"{_URL}: every sentinel is written sentinel://host:port, not {part!r}")
    _hosts(url, ";")
    _db(url.split(";")[0])
    kwargs = options.get("sentinel_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigurationError(f"{_OPTIONS}['sentinel_kwargs'] must be a dict, not {kwargs!r}")


def _check_cluster(url: str, options: Mapping[str, Any]) -> None:
    scheme = urlsplit(url).scheme.lower()
    rest = url[len(scheme) + 3 :]
    netloc, slash, path = rest.partition("/")
    if (slash and path.strip("/") not in ("", "0")) or "?db=" in url or "&db=" in url:
        raise ConfigurationError(
            f"{_URL} {url!r} names a database, but a Redis Cluster has only database 0; drop the /N"
        )
    hosts = netloc.rpartition("@")[2]
    _hosts(",".join(f"{scheme}://{host}" for host in hosts.split(",")), ",")


def redis_database(url: str) -> int:
    """The database number of a ``redis://``, ``rediss://``, ``unix://`` or (first) ``sentinel://``
    URL (0 when it names none)."""
    return _db(url.split(";")[0])


def _db(url: str) -> int:
    parts = urlsplit(url)
    path = parts.path.strip("/")
    query = dict(parse_qsl(parts.query))
    raw = path or query.get("db", "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{_URL}: the database must be a number, not {raw!r}") from None


def is_cluster(client: Any) -> bool:
    """Whether ``client`` talks to a Redis Cluster (keys live on several nodes)."""
    return isinstance(client, RedisCluster)


def _tls_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {name: options[name] for name in _TLS_OPTIONS if name in options}
    if "ssl_cert_reqs" in kwargs:
        kwargs["ssl_cert_reqs"] = _CERT_REQS[str(kwargs["ssl_cert_reqs"]).lower()]
    return kwargs


@dataclass(frozen=True)
class ClientClasses:
    """The redis-py classes a client is made of: blocking (:data:`BLOCKING`) or ``redis.asyncio``'s,
    which mirror them, so one :func:`build_client` reads the settings for both."""

    redis: Any
    sentinel: Any
    cluster: Any
    node: Any


BLOCKING = ClientClasses(redis=redis.Redis, sentinel=Sentinel, cluster=RedisCluster, node=ClusterNode)


def build_client(target: RedisTarget, common: Mapping[str, Any], classes: ClientClasses = BLOCKING) -> Any:
    """A new client for ``target``, of ``classes``. ``common``: the connection options the library
    wants on every client (timeouts, the retry policy); transport options override the timeouts."""
    if target.factory is not None:
        client = target.factory()
        if not isinstance(client, (redis.Redis, RedisCluster)):
            raise ConfigurationError(
                f"{_CLIENT} {target.factory_name} returned {client!r}, not a Redis client"
            )
        return client
    options = dict(target.options)
    kwargs = {**common, **{name: options[name] for name in (*_TIMEOUT_OPTIONS, "max_connections", "username",
                                                            "password") if name in options}}
    scheme = target.scheme
    if scheme == SENTINEL_SCHEME:
        return _sentinel_client(target.url, options, kwargs, classes)
    if scheme in CLUSTER_SCHEMES:
        return _cluster_client(target.url, options, kwargs, classes)
    if scheme == "rediss":
        kwargs.update(_tls_kwargs(options))
    return classes.redis.from_url(target.url, **kwargs)


def _sentinel_client(
    url: str, options: Mapping[str, Any], kwargs: dict[str, Any], classes: ClientClasses
) -> Any:
    first = urlsplit(url.split(";")[0].strip())
    if first.password is not None:
        kwargs.setdefault("password", unquote(first.password))
    if first.username:
        kwargs.setdefault("username", unquote(first.username))
    sentinel_kwargs = dict(options.get("sentinel_kwargs") or {})
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in kwargs:
            sentinel_kwargs.setdefault(name, kwargs[name])
    kwargs.update(_tls_kwargs(options))
    if any(name in options for name in _TLS_OPTIONS):
        kwargs["ssl"] = True
    sentinel = classes.sentinel(_hosts(url, ";"), sentinel_kwargs=sentinel_kwargs)
    master_kwargs = {name: value for name, value in kwargs.items() if name != "max_connections"}
    return sentinel.master_for(
        str(options["master_name"]), redis_class=classes.redis, db=_db(url.split(";")[0]), **master_kwargs
    )


def _cluster_client(
    url: str, options: Mapping[str, Any], kwargs: dict[str, Any], classes: ClientClasses
) -> Any:
    scheme = urlsplit(url).scheme.lower()
    netloc = url[len(scheme) + 3 :].partition("/")[0]
    auth, _, hosts = netloc.rpartition("@")
    if auth:
        user, _, password = auth.partition(":")
        if user:
            kwargs.setdefault("username", unquote(user))
        if password:
            kwargs.setdefault("password", unquote(password))
    nodes = [classes.node(host, port) for host, port in _hosts(
        ",".join(f"redis://{host}" for host in hosts.split(",")), ",")]
    if scheme == "rediss+cluster":
        kwargs.update(_tls_kwargs(options), ssl=True)
    return classes.cluster(startup_nodes=nodes, **kwargs)


def redacted_url(url: str) -> str:
    """``url`` fit for a log line or an error: its password (in the user info or a ``password=``
    query parameter) shown as ``***``."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return "<invalid url>"
    if has_password:
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)
