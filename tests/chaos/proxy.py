"""A tiny threaded TCP proxy on loopback, to cut a client off its Redis and heal it again.

``cut()`` drops every connection through the proxy and stops listening, so new connections are
refused (ECONNREFUSED), as when a Redis host is unreachable and its port closed; ``heal()`` listens
on the same port again. ``freeze()`` is a partition that drops packets instead: connections stay
open (and new ones are accepted) but every byte is discarded, so the client only learns of it
from its own socket timeout; ``thaw()`` lets bytes through again. Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from celery_singleflight.testing import free_port

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.accepted = 0
        self.dropped = 0
        self.discarded_bytes = 0
        self._frozen = False

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="proxy-accept", daemon=True).start()
        return self

    heal = start

    @property
    def is_cut(self) -> bool:
        return self._listener is None

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`heal`."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns = list(self._conns)
            self._conns.clear()
            self.dropped += len(conns) // 2
        if listener is not None:
            _close(listener)  # shutdown wakes the accept() blocked in the accept thread
        for sock in conns:
            _close(sock)

    def close(self) -> None:
        self.cut()

    def freeze(self) -> None:
        """Discard every byte in both directions (connections stay open) until :meth:`thaw`."""
        self._frozen = True

    def thaw(self) -> None:
        self._frozen = False

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was cut
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut while this one was being accepted
                    _close(client)
                    _close(upstream)
                    continue
                self._conns.update((client, upstream))
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self._frozen:
                    self.discarded_bytes += len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
