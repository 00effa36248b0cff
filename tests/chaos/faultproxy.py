"""A threaded loopback proxy in front of Redis that faults chosen commands, for fault tests.

:class:`TcpProxy` (proxy.py) can only cut or freeze a whole link; the hard cases for the library
are narrower: "the Lua script ran on the server but its reply was lost, and redis-py sent it
again". This proxy reads RESP both ways (the client's commands; the server's RESP2/RESP3 replies,
pushes apart), pairs every reply with its command, and applies a rule's action to the commands it
selects (by name, by Lua script - sha1 or source - by a predicate over the arguments; the n-th
one, every one, or only the first time an identical command is seen):

- ``drop_reply``: the server runs the command; its reply is discarded and the client connection
  closed (replies of commands sent before it are delivered first), so redis-py retries.
- ``stall_reply(s)``: the server runs the command; its reply is held back ``s`` seconds.
- ``cut_after_send``: the command is forwarded, then the connection is closed at once.
- ``drop_command``: the connection is closed before the server sees the command.
- ``error_reply(text)``: the server never sees it; the client gets ``-text`` as its reply.

``cut()``/``heal()`` drop every connection and refuse new ones, as in :class:`TcpProxy`.
Only 127.0.0.1 is ever used; every thread is a daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, NamedTuple

from celery_singleflight.testing import free_port

__all__ = [
    "Action", "FaultProxy", "Fault", "Rule",
    "CUT_AFTER_SEND", "DROP_COMMAND", "DROP_REPLY", "error_reply", "script_sha", "stall_reply",
]

ActionKind = Literal["drop_reply", "stall_reply", "cut_after_send", "drop_command", "error_reply"]
Predicate = Callable[[list[bytes]], bool]

DRAIN_TIMEOUT = 2.0  # after a fault closes a link: how long the server may take to see EOF and hang up
_EVALSHA = frozenset({"EVALSHA", "EVALSHA_RO"})
_EVAL = frozenset({"EVAL", "EVAL_RO"})
_CONTAINERS = frozenset({  # commands whose second word names a subcommand, for commands_seen()
    "ACL", "CLIENT", "CLUSTER", "COMMAND", "CONFIG", "DEBUG", "FUNCTION", "LATENCY", "MEMORY",
    "MODULE", "OBJECT", "PUBSUB", "SCRIPT", "SLOWLOG", "XGROUP", "XINFO",
})
_SHA1 = re.compile(r"[0-9a-fA-F]{40}")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    seconds: float = 0.0  # stall_reply
    text: str = ""  # error_reply


DROP_REPLY = Action("drop_reply")
CUT_AFTER_SEND = Action("cut_after_send")
DROP_COMMAND = Action("drop_command")


def stall_reply(seconds: float) -> Action:
    return Action("stall_reply", seconds=seconds)


def error_reply(text: str) -> Action:
    """``text`` as the server would send it, e.g. ``"READONLY You can't write against a read only
    replica."`` (a leading ``-`` is optional)."""
    text = text.removeprefix("-")
    if "\r" in text or "\n" in text:
        raise ValueError("a RESP error is one line")
    return Action("error_reply", text=text)


class Fault(NamedTuple):
    action: ActionKind
    command: str  # upper-cased first word
    sha: str | None  # the script's sha1 for EVAL/EVALSHA(_RO)
    at: float  # time.monotonic() when the fault was done


def script_sha(script: str | bytes) -> str:
    """The sha1 a script is known by: ``script`` itself if it is one (40 hex digits), else that
    of the Lua source (as redis-py's ``Script`` and the server compute it)."""
    text = script.decode("latin-1") if isinstance(script, bytes) else script
    if _SHA1.fullmatch(text):
        return text.lower()
    return hashlib.sha1(script.encode() if isinstance(script, str) else script).hexdigest()


def command_sha(name: str, args: list[bytes]) -> str | None:
    if len(args) < 2:
        return None
    if name in _EVALSHA:
        return args[1].decode("latin-1").lower()
    if name in _EVAL:
        return hashlib.sha1(args[1]).hexdigest()
    return None


@dataclass(eq=False)
class Rule:
    """Which commands to fault and how; ``matched``/``faulted`` count the commands it selected and
    took (the first rule, in the order added, that takes a command applies its action). ``event``
    is set once a fault of this rule has been done: for ``drop_reply`` and ``stall_reply`` when the
    server's reply has come back (so the command has run), for the others when it was decided."""

    action: Action
    name: str | None = None
    sha: str | None = None
    where: Predicate | None = None
    nth: int | None = None
    first_time_only: bool = False
    times: int | None = None
    #: a ``stall_reply`` rule stalls only the replies for which this holds (the others pass and
    #: do not count): "the call that took the key", which the command alone cannot tell
    if_reply: Callable[[bytes], bool] | None = None
    matched: int = 0
    faulted: int = 0
    event: threading.Event = field(default_factory=threading.Event, repr=False)
    _words: tuple[bytes, ...] = field(default=(), init=False, repr=False)
    _seen: set[tuple[bytes, ...]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.name is not None:
            self._words = tuple(word.encode().upper() for word in self.name.split())

    def _selects(self, sha: str | None, args: list[bytes]) -> bool:
        words = self._words
        if words and tuple(arg.upper() for arg in args[: len(words)]) != words:
            return False
        if self.sha is not None and sha != self.sha:
            return False
        return self.where is None or self.where(args)

    def _takes(self, args: list[bytes]) -> bool:
        """Count a selected command; whether this rule wants to fault it."""
        self.matched += 1
        wants = self.nth is None or self.matched == self.nth
        if self.first_time_only:
            key = tuple(args)
            wants = wants and key not in self._seen
            self._seen.add(key)
        return wants and (self.times is None or self.faulted < self.times)


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self.accepted = 0  # client connections
        self.pushes = 0  # replies the server sent unasked: RESP3 pushes (or RESP2 pub/sub messages)
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._links: set[_Link] = set()
        self._rules: list[Rule] = []
        self._seen: Counter[tuple[str, str, str | None]] = Counter()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # -- rules ------------------------------------------------------------------------------------

    def add_rule(
        self,
        action: Action,
        *,
        name: str | None = None,
        script: str | bytes | None = None,
        where: Predicate | None = None,
        nth: int | None = None,
        first_time_only: bool = False,
        times: int | None = None,
        if_reply: Callable[[bytes], bool] | None = None,
    ) -> Rule:
        """Fault the commands named ``name`` (case-insensitive; "SCRIPT LOAD" matches two words)
        running ``script`` (sha1 or Lua source; EVAL, EVALSHA and their _RO forms) for which
        ``where(args)`` holds: only the ``nth`` of them (1-based), or each one the first time its
        exact argument list is seen, or every one; at most ``times`` commands (a reply stalled only
        ``if_reply(raw reply)``)."""
        rule = Rule(action, name=name, sha=None if script is None else script_sha(script), where=where,
                    nth=nth, first_time_only=first_time_only, times=times, if_reply=if_reply)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def commands_seen(self, name: str | None = None, script: str | bytes | None = None) -> int:
        """Commands the clients sent through the proxy (faulted ones too), optionally only those
        named ``name`` (one word, or two for a container command: "SCRIPT LOAD") running ``script``."""
        words = name.upper().split() if name is not None else []
        sha = None if script is None else script_sha(script)
        with self._lock:
            return sum(
                count for (first, sub, cmd_sha), count in self._seen.items()
                if (not words or (first, sub)[: len(words)] == tuple(words))
                and (sha is None or cmd_sha == sha)
            )

    def _decide(self, args: list[bytes]) -> tuple[str, str | None, Rule | None]:
        name = args[0].decode("latin-1").upper()
        sha = command_sha(name, args)
        sub = args[1].decode("latin-1").upper() if name in _CONTAINERS and len(args) > 1 else ""
        chosen = None
        with self._lock:
            self._seen[(name, sub, sha)] += 1
            for rule in self._rules:
                if rule._selects(sha, args) and rule._takes(args) and chosen is None:
                    rule.faulted += 1
                    chosen = rule
        return name, sha, chosen

    def _give_back(self, rule: Rule) -> None:
        """A command the rule took whose reply it does not want after all."""
        with self._lock:
            rule.faulted -= 1

    def _pushed(self, count: int) -> None:
        with self._lock:
            self.pushes += count

    def _done(self, rule: Rule, name: str, sha: str | None) -> None:
        with self._lock:
            self.faults.append(Fault(rule.action.kind, name, sha, time.monotonic()))
        rule.event.set()

    # -- the whole link ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="faultproxy-accept", daemon=True).start()
        return self

    heal = start

    @property
    def is_cut(self) -> bool:
        return self._listener is None

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`heal`."""
        with self._lock:
            listener, self._listener = self._listener, None
            links = list(self._links)
            self._links.clear()
        if listener is not None:
            _close(listener)
        for link in links:
            link.kill()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

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
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, client, upstream)
            with self._lock:
                if self._listener is not listener:  # cut while this one was being accepted
                    link.kill()
                    continue
                self._links.add(link)
                self.accepted += 1
            link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)


class _Entry:
    """One reply the client is owed, in the order it is owed: a command's, or a push."""

    __slots__ = ("name", "ready_at", "reply", "rule", "sha")

    def __init__(self, name: str, sha: str | None, rule: Rule | None, reply: bytes | None = None) -> None:
        self.name = name
        self.sha = sha
        self.rule = rule
        self.reply = reply
        self.ready_at = 0.0

    @property
    def kind(self) -> ActionKind | None:
        return None if self.rule is None else self.rule.action.kind


class _Link:
    """One client connection and its upstream: a thread reads the client's commands, one the
    server's replies, one writes the client's replies in order (and does the reply faults)."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.cond = threading.Condition()
        self.owed: deque[_Entry] = deque()  # every reply the client is owed, in order
        self.pending: deque[_Entry] = deque()  # forwarded commands whose reply has not come yet
        self.closing = False
        self.discarding = False  # the server's replies are no longer for the client
        self.upstream_eof = False
        self.upstream_done = threading.Event()

    def start(self) -> None:
        for target, name in ((self._read_client, "c2s"), (self._read_server, "s2c"),
                             (self._write_client, "writer")):
            threading.Thread(target=target, name=f"faultproxy-{name}", daemon=True).start()

    def abort(self) -> None:
        """Close the client at once; half-close the upstream, so the server still runs what it was
        sent, then hangs up (the server reader drains it)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        _close(self.client)
        with contextlib.suppress(OSError):
            self.upstream.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        _close(self.client)
        _close(self.upstream)

    def _read_client(self) -> None:
        reader = _CommandReader()
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    return
                batch: list[bytes] = []
                for raw, args in reader.feed(data):
                    if not args:  # a blank line or *0: the server answers nothing
                        batch.append(raw)
                        continue
                    name, sha, rule = self.proxy._decide(args)
                    kind = None if rule is None else rule.action.kind
                    if kind in (None, "drop_reply", "stall_reply"):
                        entry = _Entry(name, sha, rule)
                        with self.cond:
                            if self.closing:
                                return
                            self.owed.append(entry)
                            self.pending.append(entry)
                        batch.append(raw)
                    elif kind == "error_reply":
                        assert rule is not None
                        self.proxy._done(rule, name, sha)  # first: the client may have it at once
                        entry = _Entry(name, sha, None, f"-{rule.action.text}\r\n".encode())
                        with self.cond:
                            self.owed.append(entry)
                            self.cond.notify_all()
                    else:  # cut_after_send, drop_command
                        assert rule is not None
                        with self.cond:  # first: what the server answers from now on is discarded
                            self.discarding = True
                        if kind == "cut_after_send":
                            batch.append(raw)
                        if batch:
                            self.upstream.sendall(b"".join(batch))
                        self.proxy._done(rule, name, sha)
                        return
                if batch:
                    self.upstream.sendall(b"".join(batch))
        except (OSError, ValueError):  # a connection went away, or the client spoke no RESP
            return
        finally:
            self.abort()

    def _read_server(self) -> None:
        reader = _ReplyReader()
        try:
            while True:
                data = self.upstream.recv(65536)
                if not data:
                    return
                replies = reader.feed(data)
                stalled: list[_Entry] = []
                pushes = 0
                with self.cond:
                    if self.closing or self.discarding:
                        continue  # drain: the client is gone, or about to be
                    now = time.monotonic()
                    for raw, push in replies:
                        if push or not self.pending:  # RESP3 push (or an unrequested RESP2 reply)
                            entry = _Entry(">", None, None, raw)
                            pushes += 1
                            if self.pending:
                                self.owed.insert(self.owed.index(self.pending[0]), entry)
                            else:
                                self.owed.append(entry)
                            continue
                        entry = self.pending.popleft()
                        entry.reply = raw
                        if entry.kind == "stall_reply":
                            assert entry.rule is not None
                            if entry.rule.if_reply is not None and not entry.rule.if_reply(raw):
                                self.proxy._give_back(entry.rule)
                                entry.rule = None  # passed on as it is
                                continue
                            entry.ready_at = now + entry.rule.action.seconds
                            stalled.append(entry)
                    self.cond.notify_all()
                for entry in stalled:
                    assert entry.rule is not None
                    self.proxy._done(entry.rule, entry.name, entry.sha)
                if pushes:  # counted last: a test that saw a push also sees what came before it
                    self.proxy._pushed(pushes)
        except (OSError, ValueError):
            return
        finally:
            with self.cond:
                self.upstream_eof = True
                self.cond.notify_all()
            self.upstream_done.set()

    def _write_client(self) -> None:
        try:
            while True:
                ready, dropped = self._next_out()
                if ready:
                    self.client.sendall(b"".join(ready))
                if dropped is not None:
                    assert dropped.rule is not None
                    self.proxy._done(dropped.rule, dropped.name, dropped.sha)
                    return
                if not ready:
                    return
        except OSError:
            return
        finally:
            self.abort()
            self.upstream_done.wait(DRAIN_TIMEOUT)
            _close(self.upstream)
            self.proxy._forget(self)

    def _next_out(self) -> tuple[list[bytes], _Entry | None]:
        """Wait for replies the client can have now; with the ``drop_reply`` entry reached, if any.
        Nothing at all: the link is over."""
        with self.cond:
            while True:
                if self.closing:
                    return [], None
                ready: list[bytes] = []
                now = time.monotonic()
                while self.owed and self.owed[0].reply is not None and self.owed[0].ready_at <= now:
                    entry = self.owed.popleft()
                    if entry.kind == "drop_reply":
                        return ready, entry
                    ready.append(entry.reply)  # type: ignore[arg-type]
                if ready:
                    return ready, None
                head = self.owed[0] if self.owed else None
                if head is not None and head.reply is not None:
                    self.cond.wait(head.ready_at - now)  # a stalled reply
                elif self.upstream_eof:
                    return [], None  # the server hung up and nothing more is owed that will come
                else:
                    self.cond.wait()


class _CommandReader:
    """Splits the client's byte stream into commands (RESP arrays of bulk strings, or inline
    lines), across recv() boundaries without parsing anything twice."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._start = 0  # where the command being read begins
        self._pos = 0  # the next byte to read
        self._want = -1  # arguments still to read of the current array; -1: between commands
        self._args: list[bytes] = []

    def feed(self, data: bytes) -> list[tuple[bytes, list[bytes]]]:
        """The commands ``data`` completes, each as (its bytes, its arguments)."""
        self._buf += data
        out = []
        while (command := self._next()) is not None:
            out.append(command)
        if self._start:
            del self._buf[: self._start]
            self._pos -= self._start
            self._start = 0
        return out

    def _next(self) -> tuple[bytes, list[bytes]] | None:
        buf = self._buf
        if self._want < 0:
            if self._pos >= len(buf):
                return None
            if buf[self._pos] != ord("*"):  # an inline command, as typed into telnet
                eol = buf.find(b"\n", self._pos)
                return None if eol < 0 else self._emit(eol + 1, bytes(buf[self._pos : eol]).split())
            header = _header(buf, self._pos)
            if header is None:
                return None
            count, self._pos = header
            if count <= 0:
                return self._emit(self._pos, [])
            self._want, self._args = count, []
        while self._want > 0:
            if self._pos >= len(buf):
                return None
            if buf[self._pos] != ord("$"):
                raise ValueError(f"expected a bulk string, got {bytes(buf[self._pos : self._pos + 20])!r}")
            header = _header(buf, self._pos)
            if header is None:
                return None
            size, body = header
            if len(buf) < body + size + 2:
                return None
            self._args.append(bytes(buf[body : body + size]))
            self._pos = body + size + 2
            self._want -= 1
        self._want = -1
        return self._emit(self._pos, self._args)

    def _emit(self, end: int, args: list[bytes]) -> tuple[bytes, list[bytes]]:
        raw = bytes(self._buf[self._start : end])
        self._start = self._pos = end
        return raw, args


class _ReplyReader:
    """Splits the server's byte stream into complete replies, RESP2 and RESP3 (attributes go
    with the reply they precede; pushes are flagged), across recv() boundaries."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._start = 0  # where the reply being read begins
        self._pos = 0  # the next item to read
        self._stack: list[list[int]] = []  # open aggregates: [elements still to read, is attribute]
        self._push = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """The replies ``data`` completes, each as (its bytes, whether it is a push)."""
        self._buf += data
        buf, out = self._buf, []
        while self._pos < len(buf):
            kind = buf[self._pos]
            eol = buf.find(b"\r\n", self._pos + 1)
            if eol < 0:
                break
            end, count, attribute = eol + 2, 0, kind == ord("|")
            if kind in b"+-:_,#(":
                pass
            elif kind in b"$=!":
                size = int(buf[self._pos + 1 : eol])
                if size >= 0:
                    if len(buf) < end + size + 2:
                        break
                    end += size + 2
            elif kind in b"*~>%|":
                count = int(buf[self._pos + 1 : eol])
                count *= 2 if kind in b"%|" else 1
            else:
                raise ValueError(f"not a RESP reply: {bytes(buf[self._pos : self._pos + 20])!r}")
            if not self._stack and not attribute:
                self._push = kind == ord(">")
            self._pos = end
            if count > 0:
                self._stack.append([count, attribute])
            elif self._complete(attribute):
                out.append((bytes(buf[self._start : self._pos]), self._push))
                self._start = self._pos
        if self._start:
            del buf[: self._start]
            self._pos -= self._start
            self._start = 0
        return out

    def _complete(self, attribute: bool) -> bool:
        """An item was read whole; whether that completes a reply."""
        while True:
            if attribute:  # an attribute is not an element of its aggregate, nor a reply
                return False
            if not self._stack:
                return True
            top = self._stack[-1]
            top[0] -= 1
            if top[0]:
                return False
            self._stack.pop()
            attribute = bool(top[1])


def _header(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """The number after the type byte at ``pos``, and where the line ends; None if incomplete."""
    eol = buf.find(b"\r\n", pos + 1)
    return None if eol < 0 else (int(buf[pos + 1 : eol]), eol + 2)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
