"""Check the protocol's models with SPIN, exhaustively, for each configuration: lease.pml (the
lease protocol of one key, and hold()) and waiting.pml (delayed copies, the fair gate, ordered).

    python model/check.py                 every configuration; exit 1 on any error
    python model/check.py --seed NAME     with one safeguard removed: must find a counterexample
    python model/check.py --seeds         every seeded fault, and every open defect, shows
    python model/check.py --trail CONFIG  print the counterexample of a configuration, step by step
    python model/check.py --config C --define NAME   one configuration with an extra define

Each configuration names its model and is one key under stated bounds (slots, runs and their
policies, faults). SPIN writes a C verifier (pan.c) that gcc builds; the search is exhaustive (no
bit-state hashing) and must not be cut by its depth limit. The verifiers run two at a time (``-j``),
at the lowest CPU priority. Needs ``spin`` and ``gcc`` on the PATH.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
#: the search's depth limit: a run that reaches it was cut, which counts as a failure
DEPTH = 1_000_000
#: no extra defines by default (a seeded fault adds one)
FIXES: tuple[str, ...] = ()
#: verifiers at a time: the machine's two cores (each verifier is one process)
JOBS = min(2, os.cpu_count() or 1)


@dataclass(frozen=True)
class Config:
    name: str
    what: str
    defines: dict[str, str | int]
    model: str = "lease.pml"
    #: an open defect's configuration: the assertion (property) its counterexample breaks
    breaks: str = ""
    #: gcc's optimisation: -O1 builds in half the time of -O2 and searches nearly as fast; a small
    #: state space is searched sooner than even -O1 builds
    opt: str = "-O1"


def waiting(name: str, what: str, defines: dict[str, str | int], breaks: str = "",
            opt: str = "-O0") -> Config:
    """A configuration of waiting.pml."""
    return Config(name, what, defines, "waiting.pml", breaks, opt)


CONFIGS = (
    Config("lost-replies", "1 slot; queue, join, queue; a reply lost",
           {"RUNS": 3, "P0": "QUEUE", "P1": "JOIN", "P2": "QUEUE", "LOSSES": 1}),
    Config("deaths", "1 slot; queue x3; a worker dies",
           {"RUNS": 3, "P0": "QUEUE", "P1": "QUEUE", "P2": "QUEUE", "DEATHS": 1}),
    Config("pauses", "1 slot; queue, join; a holder freezes past its TTL, a parked run is slow",
           {"RUNS": 2, "P0": "QUEUE", "P1": "JOIN", "PAUSES": 1, "SLOW": 1}),
    Config("pauses-no-results", "as pauses, for a task that keeps no result state",
           {"RUNS": 2, "P0": "QUEUE", "P1": "JOIN", "PAUSES": 1, "SLOW": 1, "IGNORE_RESULT": 1}),
    Config("two-slots", "max_concurrency 2; queue x3; a reply lost",
           {"SLOTS": 2, "RUNS": 3, "P0": "QUEUE", "P1": "QUEUE", "P2": "QUEUE", "LOSSES": 1}),
    Config("coalesce", "1 slot; coalesce x3; a reply lost",
           {"RUNS": 3, "P0": "COALESCE", "P1": "COALESCE", "P2": "COALESCE", "LOSSES": 1}),
    Config("supersede", "1 slot; supersede x2; a reply lost, a holder freezes",
           {"RUNS": 2, "P0": "SUPERSEDE", "P1": "SUPERSEDE", "LOSSES": 1, "PAUSES": 1}),
    Config("skip-retry", "1 slot; skip, retry, queue; a reply lost, a worker dies",
           {"RUNS": 3, "P0": "SKIP", "P1": "RETRY", "P2": "QUEUE", "LOSSES": 1, "DEATHS": 1}),
    Config("joined-death", "1 slot; queue, join, queue; a worker dies (a releaser before it answers)",
           {"RUNS": 3, "P0": "QUEUE", "P1": "JOIN", "P2": "QUEUE", "DEATHS": 1}),
    Config("two-slots-slow", "max_concurrency 2; queue x3, no result state; a parked run is slow",
           {"SLOTS": 2, "RUNS": 3, "P0": "QUEUE", "P1": "QUEUE", "P2": "QUEUE", "SLOW": 1,
            "IGNORE_RESULT": 1}),
    Config("restart-empty", "1 slot; queue, join; Redis restarts empty",
           {"RUNS": 2, "P0": "QUEUE", "P1": "JOIN", "RESTORES": 1, "OLDER": 0}),
    Config("restore", "1 slot; queue, join; Redis restarts from an older snapshot or empty (journal marks)",
           {"RUNS": 2, "P0": "QUEUE", "P1": "JOIN", "RESTORES": 1}),
    Config("hold", "1 slot; hold(), join, queue; a worker dies",
           {"RUNS": 3, "P0": "HOLD", "P1": "JOIN", "P2": "QUEUE", "DEATHS": 1}),
    waiting("delayed-deaths", "a delayed run; a worker dies (a claimant too), a late message, a reply lost",
            {"DELAYED": 1, "RUNS": 1, "DEATHS": 1, "LATE": 1, "LOSSES": 1}),
    waiting("delayed-retry", "a delayed run held by another run (retry: delayed again); a worker dies",
            {"DELAYED": 1, "RUNS": 2, "HOLDER": 1, "DEATHS": 1}),
    waiting("delayed-retry-lost",
            "a delayed run held by another run (retry); its DELAY's reply lost, sent again late",
            {"DELAYED": 1, "RUNS": 2, "HOLDER": 1, "LOSSES": 1}),
    waiting("delayed-retry-pauses", "a delayed run held by another run (retry); a claimant freezes and wakes",
            {"DELAYED": 1, "RUNS": 2, "HOLDER": 1, "PAUSES": 1}),
    waiting("delayed-pauses", "a delayed run; a claimant freezes past its patience and wakes, a reply lost",
            {"DELAYED": 1, "RUNS": 1, "PAUSES": 1, "LOSSES": 1}),
    waiting("delayed-error", "a delayed run; CLAIM_DONE at its start runs, its client sees a Redis error",
            {"DELAYED": 1, "RUNS": 1, "ERRORS": 1}),
    waiting("delayed-second-copy", "a delayed run; a claimant freezes, a copy is slow to be noted",
            {"DELAYED": 1, "RUNS": 1, "PAUSES": 1, "SLOW": 1}),
    waiting("delayed-woken", "a delayed run; a claimant freezes and wakes (P8: RunLost, a lease run out)",
            {"DELAYED": 1, "RUNS": 1, "PAUSES": 1}),
    waiting("fair-lost", "fair gate, 1 slot; 3 runs; a worker dies (a hand-on message with it)",
            {"FAIR": 1, "SLOTS": 1, "RUNS": 3, "DEATHS": 1}),
    waiting("fair-slots", "fair gate, 2 slots; 3 runs; a reservation's run is slow",
            {"FAIR": 1, "SLOTS": 2, "RUNS": 3, "SLOW": 1}),
    waiting("fair-copies", "fair gate, 2 slots; 2 runs; the broker delivers a message twice, a worker dies",
            {"FAIR": 1, "SLOTS": 2, "RUNS": 2, "DUPS": 1, "DEATHS": 1}),
    waiting("fair-second-copy", "fair gate, 2 slots; a run's message twice while its reservation ran out",
            {"FAIR": 1, "SLOTS": 2, "RUNS": 2, "DUPS": 1, "SLOW": 1}),
    waiting("fair-start", "fair gate, 1 slot; a worker dies between the gate's take and the run's start",
            {"FAIR": 1, "SLOTS": 1, "RUNS": 2, "DEATHS": 1, "START_WINDOW": 1}),
    waiting("ordered", "ordered=True; 3 runs; a message never arrives, a worker dies, a message is slow",
            {"ORDERED": 1, "RUNS": 3, "MISSING": 1, "DEATHS": 1, "SLOW": 1}),
)

#: configurations the protocol does not pass yet: each shows an open defect the model found (see
#: model/README.md); they must keep failing until it is fixed, then move to CONFIGS (``breaks``:
#: the assertion its counterexample breaks). None now
OPEN: tuple[Config, ...] = ()

#: seeded faults: the safeguard removed, the configuration that must then fail, the assertion
#: (property) its counterexample must break, and the defines it is checked with
SEEDS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "NO_FENCE_CHECK": ("the fence check at the resource (Kleppmann's paused holder)", "pauses",
                       "fence>=resource", ()),
    "NO_RELEASE_GUARD": ("RELEASE's replay guard (rt, by, settled)", "lost-replies", "out[i]>=3", ()),
    "NO_FENCE_CLOCK": ("the clock in the fence (fences would be last + 1)", "restart-empty", "nf>maxfence",
                       ()),
    "NO_REPLACE": ("COALESCE's replacement of the pending run", "coalesce", "tmp<=1", ()),
    "NO_ONE_RESERVATION": ("a hand-on skipping a run whose reservation on another slot ran out (it waits"
                           " for that one); with NO_ADOPTED_FIRST, either alone covers", "two-slots-slow",
                           "ran[r]<=1", ("NO_ADOPTED_FIRST",)),
    # ACQUIRE's ADOPTED matters where no result state is kept: elsewhere a hand-off of a run that
    # succeeded is dropped by its state too
    "NO_ADOPTED": ("ACQUIRE's memory of parked runs that took their slot (a task without results)",
                   "pauses", "ran[r]<=1", ("IGNORE_RESULT=1",)),
    "NO_MARKS": ("the journal marks (the recovery trusts the epoch alone)", "restore", "out[i]>=3", ()),
    "NO_CLAIM_OWNER": ("RESEND's take-back of a claim whose claimant is gone", "delayed-deaths",
                       "out[i]>=3", ()),
    "NO_TAKE_BACK": ("CLAIM_DONE's TAKEN_BACK to a claimant whose claim was taken back", "delayed-pauses",
                     "ran[0]<=1", ()),
    "NO_RESEND_ON_ERROR": ("started(): a run whose CLAIM_DONE met a Redis error is sent again (defect 13)",
                           "delayed-error", "out[i]>=3", ()),
    "NO_OWN_ATTEMPT_WAIT": ("wait_for_own_attempt: a claimant held by its run's stale attempt is not"
                            " turned away (defect 14)", "delayed-second-copy", "out[i]>=3", ()),
    "NO_TOOK_KEPT": ("RESEND keeps `took` until a copy claims; with NO_OWN_ATTEMPT_WAIT, either alone"
                     " covers (defect 14)", "delayed-second-copy", "out[i]>=3", ("NO_OWN_ATTEMPT_WAIT",)),
    "NO_LIVE_ATTEMPT": ("verdict: a later attempt holding the run's lease is LIVE (defect 15)",
                        "delayed-woken", "lostlive", ()),
    "NO_DELAY_IF_CLAIMED": ("DELAY again only while the caller's claim stands (defect 18)", "delayed-woken",
                            "ran[0]<=1", ()),
    "NO_REPLAY_NOT_CLAIMED": ("DELAY sent again after a copy claimed the run answers NOT_CLAIMED (defect D)",
                              "delayed-retry-lost", "out[i]>=3", ()),
    "NO_RESERVATION_EXPIRY": ("a reservation's deadline (a lost hand-on message)", "fair-lost", "out[i]>=3",
                              ()),
    "NO_GATE_ADOPTED": ("FAIR_ENTER's memory of the runs that took their slot (a second copy); with"
                        " NO_ADOPTED_FIRST, either alone covers", "fair-copies", "ran[r]<=1",
                        ("NO_ADOPTED_FIRST",)),
    "NO_ADOPTED_FIRST": ("ACQUIRE's taken_before before adopting; with NO_RENEWED_RESERVATION, either"
                         " alone covers (defect 16)", "fair-second-copy", "ran[r]<=1",
                         ("NO_RENEWED_RESERVATION",)),
    "NO_PROVISIONAL": ("watch_take: the provisional started-index member before a take (defect 17)",
                       "fair-start", "out[i]>=3", ()),
    "NO_ORDER_SWEEP": ("ORDER_SWEEP's skip of a number whose message never came", "ordered", "out[i]>=3",
                       ()),
}


@dataclass
class Result:
    config: str
    errors: int
    states: int
    transitions: int
    depth: int
    seconds: float
    complete: bool
    output: str
    workdir: Path

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.complete


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else -1


def verify(config: Config, extra: tuple[str, ...] = FIXES, workdir: Path | None = None) -> Result:
    """Build and run the verifier of one configuration (in ``workdir``, a new one by default)."""
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed (Debian: apt-get install spin gcc)")
    work = workdir or Path(tempfile.mkdtemp(prefix=f"model-{config.name}-"))
    shutil.copy(HERE / config.model, work / config.model)
    flags = [f"-D{name}={value}" for name, value in config.defines.items()] + [f"-D{name}" for name in extra]
    start = time.monotonic()
    subprocess.run(["spin", *flags, "-a", config.model], cwd=work, check=True, capture_output=True, text=True)
    subprocess.run(["gcc", config.opt, "-w", "-DSAFETY", "-DCOLLAPSE", "-DVECTORSZ=4096", "-o", "pan",
                    "pan.c"], cwd=work, check=True, capture_output=True, text=True)
    run = subprocess.run(["./pan", f"-m{DEPTH}", "-w24"], cwd=work, capture_output=True, text=True)
    seconds = time.monotonic() - start
    text = run.stdout + run.stderr
    errors = _number(r"errors: (\d+)", text)
    depth = _number(r"depth reached (\d+)", text)
    complete = "max search depth too small" not in text and depth < DEPTH and errors >= 0
    return Result(config.name, errors, _number(r"(\d+) states, stored", text),
                  _number(r"(\d+) transitions", text), depth, seconds, complete, text, work)


def trail(result: Result, config: Config, extra: tuple[str, ...] = FIXES) -> str:
    """The counterexample SPIN found, as the model's own step-by-step printout."""
    flags = [f"-D{name}={value}" for name, value in config.defines.items()] + [f"-D{name}" for name in extra]
    run = subprocess.run(["spin", *flags, "-t", config.model], cwd=result.workdir, capture_output=True,
                         text=True)
    lines = [line.strip() for line in run.stdout.splitlines()]
    keep = [line for line in lines if line and not re.match(r"^[A-Za-z_.\[\]0-9]+ = ", line)
            and not re.match(r"^\d+:\s+proc", line) and "processes created" not in line
            and not line.startswith(("#processes", "spin: trail ends", "spin: warning"))]
    return "\n".join(keep)


def seeded(seed: str) -> tuple[str, ...]:
    """The defines of a seeded fault: the seed first, then those it is checked with."""
    return (*FIXES, seed, *SEEDS[seed][3])


def by_name(name: str) -> Config:
    for config in (*CONFIGS, *OPEN):
        if config.name == name:
            return config
    raise SystemExit(f"no configuration {name!r}: {', '.join(c.name for c in (*CONFIGS, *OPEN))}")


def run_all(jobs: list[tuple[Config, tuple[str, ...]]], workers: int) -> Iterator[Result]:
    """Verify each (configuration, extra defines), ``workers`` at a time; results in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(verify, config, extra) for config, extra in jobs]
        for future in futures:
            yield future.result()


def check_seeds(workers: int) -> int:
    """Each seeded fault must break the property it names, and each open defect must still show,
    breaking its own (fixed? move its configuration to CONFIGS); 1 if one does not."""
    failed = 0
    seeds = sorted(SEEDS.items())
    # a seeded search ends at its first counterexample, mostly within seconds: built without -O2
    jobs = [(dataclasses.replace(by_name(name), opt="-O0"), seeded(seed)) for seed, (_, name, _, _) in seeds]
    jobs += [(config, FIXES) for config in OPEN]
    for n, ((config, extra), result) in enumerate(zip(jobs, run_all(jobs, workers), strict=True)):
        story = trail(result, config, extra) if result.errors > 0 else ""
        if n >= len(seeds):
            shows = result.errors > 0 and config.breaks in story.replace(" ", "")
            verdict = "still shows" if shows else "FIXED? move it"
            print(f"{'open: ' + config.name:<26} {verdict:<15} {config.what}", flush=True)
        else:
            seed = extra[len(FIXES)]
            what, name, assertion, _ = SEEDS[seed]
            shows = result.errors > 0 and assertion in story.replace(" ", "")
            verdict = "counterexample" if shows else "NOT CAUGHT"
            print(f"{seed:<26} {verdict:<15} {name:<20} {what}", flush=True)
        failed += not shows
        shutil.rmtree(result.workdir, ignore_errors=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", choices=sorted(SEEDS),
                        help="remove one safeguard: a counterexample must follow")
    parser.add_argument("--seeds", action="store_true",
                        help="every seeded fault breaks its property, every open defect still shows")
    parser.add_argument("--trail", metavar="CONFIG", help="print the counterexample of CONFIG")
    parser.add_argument("--config", action="append", help="only these configurations")
    parser.add_argument("--define", action="append", default=[], metavar="NAME",
                        help="an extra define, e.g. a seeded fault (NO_TAKE_BACK)")
    parser.add_argument("-j", "--jobs", type=int, default=JOBS, help=f"verifiers at a time (default {JOBS})")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:  # make test: skipped locally, a failure in CI (.ci/run installs them)
        print(f"the model check needs {' and '.join(missing)} (Debian: apt-get install spin gcc)")
        return 1 if os.environ.get("CI") == "true" else 0
    if args.seeds:
        return check_seeds(args.jobs)
    if args.seed:
        what, name, _, _ = SEEDS[args.seed]
        config = by_name(name)
        result = verify(config, seeded(args.seed))
        print(f"{args.seed} ({what}), configuration {name}: {result.errors} error(s)")
        if result.errors > 0:
            print(trail(result, config, seeded(args.seed)))
        return 0 if result.errors > 0 else 1
    configs = [by_name(n) for n in args.config] if args.config else list(CONFIGS)
    extra = (*FIXES, *args.define)
    if args.trail:
        config = by_name(args.trail)
        result = verify(config, extra)
        print(trail(result, config, extra) if result.errors else "no counterexample")
        return 0
    print(f"{'configuration':<18} {'states':>12} {'transitions':>12} {'depth':>6} {'errors':>6}"
          f" {'seconds':>8}")
    failed = 0
    for config, result in zip(configs, run_all([(c, extra) for c in configs], args.jobs), strict=True):
        print(f"{config.name:<18} {result.states:>12,} {result.transitions:>12,} {result.depth:>6} "
              f"{result.errors:>6} {result.seconds:>8.1f}   {config.model}: {config.what}", flush=True)
        if not result.ok:
            failed += 1
            print(result.output if result.errors <= 0 else trail(result, config, extra), file=sys.stderr)
        else:
            shutil.rmtree(result.workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    sys.exit(main())
