"""Every TTL, retention and timing number of the library, in one table (seconds unless named).

The options a user sets (``lock_ttl``, ``status_retention``, ``dedup_ttl`` ...) are declared with
their option; these are the numbers the library picks itself. The Lua scripts get the ones they
use as constants in milliseconds (:data:`LUA_CONSTANTS`), the key table of the docs reads its TTL
column from here (:mod:`.protocol.layout`), and nothing else spells them.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE_ATTEMPTS", "ADOPTED_KEEP", "ANSWER_GRACE", "CLIENT_BACKOFF_BASE", "CLIENT_BACKOFF_CAP",
    "CLIENT_HEALTH_CHECK",
    "CLIENT_RETRIES", "CONNECT_TIMEOUT", "DEBOUNCE_CLOSED_KEEP", "DEBOUNCE_GRACE", "DEBOUNCE_LEADER_EARLY",
    "DELAYING_OPTIONS",
    "DELAYED_GRACE", "DELAYED_KEEP",
    "FAIR_INDEXED_FRESH", "FAIR_KEEP", "FAIR_TIMES_KEPT",
    "DELAYED_CLAIM_PATIENCE", "DELAYED_OLD_KEPT", "DELAYED_RECHECK", "DELAYED_UNSEEN_GRACE",
    "HEARTBEAT_ERROR_RETRY", "HOLD_FIRST_DELAY", "HOLD_MAX_DELAY", "HOLD_MIN_DELAY", "LEASE_MARGIN",
    "JOURNAL_COMPACT", "JOURNAL_KEEP",
    "LEASE_MARGIN_SHARE", "LOST_KEPT", "LOST_RUN_GRACE", "LUA_CONSTANTS", "MAX_CLOCK_SKEW", "NEWEST_KEEP",
    "ORDER_KEEP",
    "PROBE_CONNECT_TIMEOUT", "PROBE_SOCKET_TIMEOUT", "RATE_EARLY_ALLOWANCE", "RATE_GRANT_KEEP", "RATE_LATE",
    "RECOVER_ATTEMPTS",
    "REPLAY_WINDOW", "RESUME_GRACE", "RETRY_FIRST_WAIT", "RETRY_MIN_DELAY", "REVOKE_AGAIN", "SETTLE_KEEP",
    "SKIPPED_KEPT", "SOCKET_TIMEOUT", "SWEEP_INTERVAL", "WATCH_POLL", "WORKER_GONE_AFTER",
]

# -- the run record and its replays ---------------------------------------------------------

#: the shortest time a run record outlives its run: longer than redis-py takes to send a command
#: again after a lost reply, so a re-sent release still finds the proof of the first
REPLAY_WINDOW = 30.0
#: how long joined runs handed to a releaser stay readable for a replay of that release
SETTLE_KEEP = 120.0
#: how long a releaser may take to answer the runs joined to its run before a sweeper answers
#: those still waiting (its whole worker was lost between the release and the answers)
ANSWER_GRACE = 10.0
#: how many fences of runs whose lease ran out a record remembers (``lost``)
LOST_KEPT = 8

# -- a run's lease, seen from its own process ------------------------------------------------

#: a holder counts its lease lost this long before its TTL is up (clock drift, the time between
#: a check and the write it guards): at most :data:`LEASE_MARGIN`, and at most this share of the TTL
LEASE_MARGIN = 1.0
LEASE_MARGIN_SHARE = 0.1
#: a renewal that failed with a Redis error is tried again after this long
HEARTBEAT_ERROR_RETRY = 1.0
#: how often a run asks for its key again when each attempt finds it free but handed on
ACQUIRE_ATTEMPTS = 5

# -- waiting runs: the sweeper --------------------------------------------------------------

#: how often each worker's sweeper looks at the due keys of its namespaces
SWEEP_INTERVAL = 1.0
#: how long after a holder's lease would run out the sweeper looks at its key
RESUME_GRACE = 0.5
#: how long after a started run's lease would run out the sweeper looks whether it was lost
LOST_RUN_GRACE = 1.0
#: after revoking a superseded run, when to look again (and revoke again if it still holds its key)
REVOKE_AGAIN = 5.0
#: how long a key remembers the handoff tokens of the parked runs that took their slot: another
#: copy of such a run's message (sent again by ``fail_closed``, or by a sweeper whose reservation
#: ran out meanwhile) is dropped, not run a second time
ADOPTED_KEEP = 3600.0
#: how long a fair gate's order outlives its last parked run (a run waiting longer keeps its place
#: in the queue; only the order of later arrivals around it is lost)
FAIR_KEEP = 86_400.0
#: how many recent run times a fair gate keeps for its waiters' ETA
FAIR_TIMES_KEPT = 20
#: a process that entered a fair gate in the waiting index this recently (seconds), as soon or
#: sooner, does not enter it again for a run parked behind others (it is there: its queue was
#: not empty): a burst is parked at one round trip per run, not two
FAIR_INDEXED_FRESH = 1.0
#: how long the book of a key's newest pending run outlives its last change
NEWEST_KEEP = 86_400.0
#: how long the order book of a key outlives its last change
ORDER_KEEP = 86_400.0
#: how many skipped sequence numbers an order book remembers (a late arrival of one runs by arrival)
SKIPPED_KEPT = 32
#: how often a worker drops from its journal the runs that no longer wait in Redis
JOURNAL_COMPACT = 5.0
#: how long a key keeps the journal marks of the runs that waited on it after its last new one (a
#: worker drops a mark with its journal line, within :data:`JOURNAL_COMPACT`; this bounds the
#: marks of a worker that never comes back)
JOURNAL_KEEP = 86_400.0
#: how many sweeps a recovered run's send may fail before it ends FAILURE (``WaitingLost``)
RECOVER_ATTEMPTS = 3

# -- duplicates that wait: retry, hold() ----------------------------------------------------

#: the first wait of the ``retry`` policy when ``retry_backoff`` is not set
RETRY_FIRST_WAIT = 0.1
#: the ``retry`` policy's waits are never shorter (a jittered wait of a tiny backoff)
RETRY_MIN_DELAY = 0.05
#: ``hold(wait=...)``: a jittered backoff between these bounds while the key is held
HOLD_FIRST_DELAY = 0.05
HOLD_MAX_DELAY = 1.0
HOLD_MIN_DELAY = 0.02

# -- time policies --------------------------------------------------------------------------

#: how long past a burst's due time another call waits before it takes a lost leader's place
DEBOUNCE_GRACE = 1.0
#: how long the last closed burst of a key is kept (replays, late and re-sent messages)
DEBOUNCE_CLOSED_KEEP = 600.0
#: a burst's leader goes ahead this early: the broker's countdown timers are not exact
DEBOUNCE_LEADER_EARLY = 0.005
#: how long a granted rate-limit cell is remembered after its planned start (a re-sent run that
#: arrives later takes a new cell: later, never earlier)
RATE_GRANT_KEEP = 60.0
#: a re-sent rate-limited run that arrives this early still starts
RATE_EARLY_ALLOWANCE = 0.002
#: a rate-limited run that comes this long after its cell (or one interval, if longer) takes a new
#: cell: runs held up by a dead worker or an outage must not all start at once
RATE_LATE = 1.0
#: a delayed run whose countdown message has not started this long after its due time (the
#: worker holding that message died) is sent again from its copy in Redis by a sweeper
DELAYED_GRACE = 1.0
#: how long a delayed run's copy in Redis outlives its due time: a copy the sweeper sent again is
#: kept as long as the first message may still come back (the Redis broker's visibility timeout:
#: an hour by default, 12 h where long countdowns are used), so that the two never both run
DELAYED_KEEP = 86_400.0
#: a delayed run whose message a live worker holds (received, not started: the worker is busy) is
#: looked at again this often; a copy is sent only once no worker holding one is alive
DELAYED_RECHECK = 2.0
#: how many tokens of a delayed run's earlier delays its entry remembers (their messages are stale)
DELAYED_OLD_KEPT = 8
#: a worker whose sweeper has not said it is alive for this long is gone (its sweep runs each second)
WORKER_GONE_AFTER = 3.0
#: a delayed run no worker noted receiving (its message waits in the broker, or the worker died
#: before noting it) gets its copy sent this long after its due time: a copy sent early is
#: harmless (of the copies that start, one claims the run; the others are dropped)
DELAYED_UNSEEN_GRACE = 3.0
#: a delayed run claimed by a run that has not said it started or ended this long after its claim
#: (its pool process died alone, or it hangs before its start) has its claim taken back and its
#: copy sent again, even while the claimant's worker lives (a copy taken back never starts)
DELAYED_CLAIM_PATIENCE = 10.0

# -- Redis connections ----------------------------------------------------------------------

#: the library's clients: an outage is seen within seconds, and a lost reply is sent again
CONNECT_TIMEOUT = 2.0
SOCKET_TIMEOUT = 5.0
CLIENT_HEALTH_CHECK = 30.0
CLIENT_RETRIES = 2
CLIENT_BACKOFF_BASE = 0.05
CLIENT_BACKOFF_CAP = 0.5
#: the worker's start checks use a short-lived client of their own
PROBE_CONNECT_TIMEOUT = 2.0
PROBE_SOCKET_TIMEOUT = 3.0
#: the start checks warn beyond this difference between Redis's clock and the worker's
MAX_CLOCK_SKEW = 1.0
#: the task options whose runs wait in the lease Redis as delayed runs (the start checks name the
#: tasks that set one when that Redis has no append-only file)
DELAYING_OPTIONS = ("debounce", "key_rate_limit")

# -- operators ------------------------------------------------------------------------------

#: how long a watch waits on its key's history stream before it looks at the key again
WATCH_POLL = 0.5


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


#: the numbers the Lua scripts use, by the name they use (milliseconds, or counts)
LUA_CONSTANTS: dict[str, int] = {
    "SETTLE_KEEP_MS": _ms(SETTLE_KEEP),
    "ADOPTED_KEEP_MS": _ms(ADOPTED_KEEP),
    "LOST_KEPT": LOST_KEPT,
    "NEWEST_KEEP_MS": _ms(NEWEST_KEEP),
    "ORDER_KEEP_MS": _ms(ORDER_KEEP),
    "SKIPPED_KEPT": SKIPPED_KEPT,
    "DEBOUNCE_GRACE_MS": _ms(DEBOUNCE_GRACE),
    "DEBOUNCE_CLOSED_KEEP_MS": _ms(DEBOUNCE_CLOSED_KEEP),
    "DEBOUNCE_LEADER_EARLY_MS": _ms(DEBOUNCE_LEADER_EARLY),
    "RATE_GRANT_KEEP_US": round(RATE_GRANT_KEEP * 1_000_000),
    "RATE_LATE_US": round(RATE_LATE * 1_000_000),
    "DELAYED_GRACE_MS": _ms(DELAYED_GRACE),
    "DELAYED_KEEP_MS": _ms(DELAYED_KEEP),
    "DELAYED_RECHECK_MS": _ms(DELAYED_RECHECK),
    "DELAYED_OLD_KEPT": DELAYED_OLD_KEPT,
    "DELAYED_UNSEEN_GRACE_MS": _ms(DELAYED_UNSEEN_GRACE),
    "DELAYED_CLAIM_PATIENCE_MS": _ms(DELAYED_CLAIM_PATIENCE),
    "WORKER_GONE_AFTER_MS": _ms(WORKER_GONE_AFTER),
    "FAIR_KEEP_MS": _ms(FAIR_KEEP),
    "JOURNAL_KEEP_MS": _ms(JOURNAL_KEEP),
}
