"""Private production-shaped Redis set-ups for tests and benchmarks: TLS, Cluster, Sentinel.

Each one is made of private ``redis-server`` processes on loopback ports, started and stopped by
the PIDs they got (like :class:`~.testing.RedisServer`, which they build on), so they live beside
any Redis already running:

- :class:`TlsRedisServer`: TLS only (``--port 0``), with a CA and a server certificate made by
  :func:`make_tls_files` (``openssl``);
- :class:`RedisClusterServers`: a Redis Cluster of 3 masters (``--cluster-enabled yes``, slots
  assigned by ``redis-cli --cluster create``);
- :class:`SentinelGroup`: a master, a replica and 3 sentinels (``redis-server --sentinel``).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from . import NO_RETRY, RedisServer, _child_setup, redis_cli_binary, redis_server_binary, stop_process

__all__ = [
    "RedisClusterServers", "SentinelGroup", "TlsFiles", "TlsRedisServer", "cluster_port", "make_tls_files",
]


@dataclass(frozen=True)
class TlsFiles:
    """A CA and a certificate for 127.0.0.1 / localhost signed by it (PEM files)."""

    ca: str
    cert: str
    key: str

    def transport_options(self) -> dict[str, Any]:
        """``singleflight_redis_transport_options`` for a client that checks the server against
        the CA and shows the same certificate as its own (for ``tls-auth-clients yes``)."""
        return {"ssl_cert_reqs": "required", "ssl_ca_certs": self.ca, "ssl_certfile": self.cert,
                "ssl_keyfile": self.key}


def make_tls_files(directory: str | Path) -> TlsFiles:
    """Make a CA and a server/client certificate for 127.0.0.1 with the ``openssl`` command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not on PATH")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    names = ("ca.key", "ca.pem", "tls.key", "tls.csr", "tls.pem")
    ca_key, ca, key, csr, cert = (str(out / name) for name in names)
    ext = out / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
        "-subj", "/CN=singleflight test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
        "-days", "2", "-extfile", str(ext))
    return TlsFiles(ca=ca, cert=cert, key=key)


class TlsRedisServer(RedisServer):
    """A redis-server that speaks only TLS (``--port 0 --tls-port``); clients must present a
    certificate signed by the CA (``tls-auth-clients yes``)."""

    def __init__(self, tls: TlsFiles, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        super().__init__(port=port, extra=extra)
        self.tls = tls

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = super().command()
        args[args.index("--port") + 1] = "0"
        return [*args, "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert, "--tls-key-file",
                self.tls.key, "--tls-ca-cert-file", self.tls.ca, "--tls-auth-clients", "yes"]

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, ssl=True, ssl_ca_certs=self.tls.ca,
                           ssl_certfile=self.tls.cert, ssl_keyfile=self.tls.key)

    def probe(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=1.0,
                           retry=NO_RETRY, ssl=True, ssl_ca_certs=self.tls.ca, ssl_certfile=self.tls.cert,
                           ssl_keyfile=self.tls.key)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A loopback port for a cluster node: it and its bus port (+10000) free, at most 55535."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class _ClusterNode(RedisServer):
    @classmethod
    def fresh_port(cls) -> int:
        return cluster_port()

    def command(self) -> list[str]:
        return [*super().command(), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "3000", "--cluster-require-full-coverage", "yes"]


class RedisClusterServers:
    """A private Redis Cluster of ``masters`` master nodes, slots spread evenly, each with
    ``replicas`` replicas (``redis-cli --cluster create --cluster-replicas``).

    ``url`` is its ``redis+cluster://`` URL with every node as a startup node.
    """

    def __init__(self, masters: int = 3, extra: tuple[str, ...] = (), replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = [_ClusterNode(extra=extra) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def client(self) -> Any:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", node.port)  # type: ignore[no-untyped-call]
                                           for node in self.nodes])

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            cli = redis_cli_binary(self.nodes[0].binary)
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )
            deadline = time.monotonic() + timeout
            while not (all(self._ok(node) for node in self.nodes) and self._replicas_up()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok with its replicas in sync")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def _replicas_up(self) -> bool:
        """Every replica follows its master with the link up, and every node knows each one as a
        replica (Redis 6.2's masters deny a replica's failover while gossip still calls it a master)."""
        if not self.replicas:
            return True
        expected = len(self.nodes) // (1 + self.replicas) * self.replicas
        for node in self.nodes:
            client: Any = node.client()
            try:
                listed = client.execute_command("CLUSTER NODES")
            except redis.RedisError:
                return False
            finally:
                client.close()
            text = listed.decode() if isinstance(listed, bytes) else str(listed)
            if isinstance(listed, dict):
                text = "\n".join(str(entry.get("flags", "")) for entry in listed.values())
            if text.count("slave") != expected:
                return False
        up = 0
        for node in self.nodes:
            client = node.client()
            try:
                info: Any = client.info("replication")
            except redis.RedisError:
                return False
            finally:
                client.close()
            if info.get("role") == "slave":
                if info.get("master_link_status") != "up":
                    return False
                up += 1
        return up == len(self.nodes) // (1 + self.replicas) * self.replicas

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        client: Any = node.client()
        try:
            info = client.execute_command("CLUSTER INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            return "cluster_state:ok" in text or (isinstance(info, dict)
                                                  and info.get("cluster_state") == "ok")
        except redis.RedisError:
            return False
        finally:
            client.close()

    def node_on(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Sentinel:
    """One ``redis-server --sentinel`` watching ``master_name``."""

    def __init__(self, master_name: str, master_port: int, quorum: int, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 10000) -> None:
        self.port = cluster_port()
        self._dir = tempfile.mkdtemp(prefix="sf-sentinel-")
        self.config = Path(self._dir) / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self._dir}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {master_name} 1\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([redis_server_binary(), str(self.config), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_child_setup())

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=2)

    def close(self) -> None:
        stop_process(self.proc)
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


class SentinelGroup:
    """A master, one replica and ``sentinels`` sentinels monitoring it as ``master_name``.

    ``url`` is Celery's ``sentinel://...;sentinel://...`` form; pass ``master_name`` in the
    transport options. :meth:`master_port` asks the sentinels which node is the master now.
    ``down_after_ms`` and ``failover_timeout_ms`` are the sentinels' ``down-after-milliseconds``
    (how soon a silent master is down) and ``failover-timeout`` (also how long a replica may
    replicate from another address than the master's, such as a proxy, before they correct it).
    """

    def __init__(self, master_name: str = "leases", sentinels: int = 3, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 10000) -> None:
        self.master_name = master_name
        self.master = RedisServer()
        self.replica = RedisServer(extra=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.servers = [self.master, self.replica]
        self.sentinels = [_Sentinel(master_name, self.master.port, 2, down_after_ms, failover_timeout_ms)
                          for _ in range(sentinels)]

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)

    def transport_options(self) -> dict[str, Any]:
        return {"master_name": self.master_name}

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        try:
            self.master.start()
            self.replica.start()
            for sentinel in self.sentinels:
                sentinel.start()
            deadline = time.monotonic() + timeout
            while not self._ready():
                if time.monotonic() > deadline:
                    raise RuntimeError("the sentinels did not see the master with its replica")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def _ready(self) -> bool:
        link = self.replica.client().info("replication").get("master_link_status")
        if link != "up":
            return False
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                state: Any = client.sentinel_master(self.master_name)
                if int(state.get("num-other-sentinels", 0)) < len(self.sentinels) - 1:
                    return False
                if int(state.get("num-slaves", 0)) < 1:
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def master_port(self) -> int:
        """The port of the master the sentinels name now."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            with contextlib.suppress(redis.RedisError):
                address: Any = client.sentinel_get_master_addr_by_name(self.master_name)
                return int(address[1])
            client.close()
        raise RuntimeError("no sentinel answered")

    def server_on(self, port: int) -> RedisServer:
        return next(server for server in self.servers if server.port == port)

    def failover(self) -> None:
        """``SENTINEL FAILOVER``: the replica is promoted, the old master becomes its replica."""
        client: Any = self.sentinels[0].client()
        client.execute_command("SENTINEL", "FAILOVER", self.master_name)

    def wait_master_change(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels name another master (and it accepts writes); its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, redis.RedisError):
                port = self.master_port()
                if port != old_port:
                    role = self.server_on(port).client().info("replication").get("role")
                    if role == "master":
                        return port
            time.sleep(0.1)
        raise RuntimeError("no failover happened")

    def close(self) -> None:
        for sentinel in self.sentinels:
            sentinel.close()
        for server in self.servers:
            server.close()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
