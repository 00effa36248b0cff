"""What the benchmarks share: the Redis they run against, how their Celery app modules are
loaded, and where their figures go (their own section of docs/benchmarks.md, and a PNG plot
beside it)."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from celery_singleflight.testing import RedisServer

HERE = Path(__file__).resolve().parent


def import_app(module: str, settings: dict[str, str]) -> tuple[ModuleType, dict[str, str]]:
    """Import a benchmark's Celery app module (``throughputapp``, ...), which reads its
    configuration from the environment when imported: here, and in the workers started later
    with the environment returned (``settings`` plus a PYTHONPATH under which they find it)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**settings, "PYTHONPATH": path}
    os.environ.update(env)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(module), env


@contextmanager
def redis_for(url: str | None) -> Iterator[tuple[str, bool]]:
    """``(url, private)``: the given Redis (``--redis-url``; the benchmark touches only keys under
    its own prefix there), else a private redis-server on a free loopback port, stopped by its
    PID afterwards."""
    if url:
        yield url, False
        return
    server = RedisServer().start()
    try:
        yield server.url, True
    finally:
        server.close()


class CallgrindServer(RedisServer):
    """A private redis-server run under ``valgrind --tool=callgrind``, its counters zeroed and
    dumped on request (``callgrind_control``): the server's instructions for a stretch of work,
    the same whatever else the machine does."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def command(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out_dir}/server.%p",
                *super().command()]

    def _control(self, flag: str) -> None:
        assert self.proc is not None
        subprocess.run(["callgrind_control", flag, str(self.proc.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        """Start counting from here."""
        self._control("-z")

    def counted(self) -> int:
        """Instructions the server executed since :meth:`zero`."""
        before = set(os.listdir(self.out_dir))
        self._control("-d")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for name in set(os.listdir(self.out_dir)) - before:
                with open(os.path.join(self.out_dir, name)) as dump:
                    # "totals:" is the dump's last line: a dump still being written has none
                    found = re.search(r"^totals: (\d+)", dump.read(), re.M)
                if found:
                    return int(found.group(1))
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump of the server")

    def instructions(self, work: Callable[[], None]) -> int:
        """Instructions the server executed while ``work`` ran."""
        self.zero()
        work()
        return self.counted()


def delete_matching(client: redis.Redis, pattern: str) -> int:
    """Delete the keys matching ``pattern`` (SCAN, UNLINK in batches) and return how many there
    were: a benchmark's own keys on a Redis it did not start, never a FLUSH."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=1_000):
        batch.append(key)
        if len(batch) == 1_000:
            deleted += int(client.unlink(*batch))
            batch.clear()
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted


# -- writing the figures into docs/benchmarks.md --------------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs"
BENCH_DOC = DOCS / "benchmarks.md"
IMAGES = DOCS / "img"


def machine() -> str:
    """One line naming the machine and the versions the figures come from."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        load = "n/a"
    return (f"{dt.date.today().isoformat()}, {os.cpu_count()} x {cpu}, load {load} at start, "
            f"Python {platform.python_version()}, redis-py {redis.__version__}")


def write_section(name: str, markdown: str, doc: Path = BENCH_DOC) -> None:
    """Replace the section between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in
    docs/benchmarks.md with ``markdown`` (appended at the end the first time): every figure in
    that page is written by the benchmark that measured it, never typed by hand."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)
    print(f"wrote the {name!r} section of {doc.relative_to(doc.parent.parent)}")


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (from the ``bench`` extra), with docs/img/ made; None
    (said once on stdout) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    IMAGES.mkdir(exist_ok=True)
    return plt


def bar_chart(name: str, title: str, labels: Sequence[str], values: Sequence[float], unit: str,
              highlight: str | None = None) -> str | None:
    """Draw a horizontal bar chart to docs/img/bench-NAME.png; return the Markdown image line, or
    None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    path = IMAGES / f"bench-{name}.png"
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(labels) + 1.2), dpi=110)
    colors = ["#d9480f" if label == highlight else "#868e96" for label in labels]
    bars = ax.barh(list(labels)[::-1], list(values)[::-1], color=colors[::-1])
    for bar, value in zip(bars, list(values)[::-1], strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:,.3g} {unit}",
                va="center", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(unit)
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"![{title}](img/{path.name})"


def version_of(dist: str) -> str:
    """The installed version of ``dist``, or "not installed"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def distinct_lines(lines: Sequence[str]) -> list[tuple[str, int]]:
    """Worker log lines each once (timestamp dropped), tagged with the first measurement that logged
    them, with how many times they came."""
    counts: dict[str, int] = {}
    first_tag: dict[str, str] = {}
    for line in lines:
        tag, _, rest = line.partition("] ")
        text = re.sub(r"^\[\d{4}-\d\d-\d\d [\d:,]+: ", "[", rest)
        counts[text] = counts.get(text, 0) + 1
        first_tag.setdefault(text, tag + "]")
    return [(f"{first_tag[text]} {text}", n) for text, n in counts.items()]


def worker_problems(log: str) -> list[str]:
    """The lines of a worker's log worth showing under a benchmark's table."""
    wanted = ("ERROR", "CRITICAL", "Traceback", "WARNING/")
    return [line for line in log.splitlines() if any(w in line for w in wanted)]
