/*
 * The lease protocol of celery_singleflight, for SPIN.
 *
 * One lock key with SLOTS slots (max_concurrency), RUNS runs sent in task-id order (the send
 * stamp of run r is r + 1), each under the policy POLICY(r). Each script of the protocol is one
 * indivisible step (d_step), as Lua is atomic on the server, and transcribes the script's
 * decisions over an abstract record:
 *
 *   script here        Lua file (celery_singleflight/protocol/lua/)
 *   ACQUIRE            lease/acquire.lua (+ acquire_plain.lua, which takes the same decisions)
 *   RELEASE            lease/release.lua (+ release_plain.lua)
 *   RENEW              lease/renew.lua
 *   PARK, JOIN         handoff/park.lua, handoff/join.lua
 *   HAND_OFF           handoff/handoff.lua: hand_off (called by ACQUIRE, RELEASE, RESUME)
 *   RESUME             handoff/resume.lua (the sweeper's look at a key with waiting runs)
 *   COALESCE           newest/coalesce.lua (modes 'last' and 'supersede')
 *   NEWEST_START       newest/start.lua
 *   FENCED_SET         fences/fenced_set.lua (the resource a holder writes)
 *   EPOCH              epoch/epoch.lua, and the journal's recovery (worker/recovery.py)
 *   (mark)             shared/common.lua `journaled`: PARK, JOIN and COALESCE (pending) add the
 *                      journal mark of the call (its journal line's) in the same script, only when
 *                      they make the run wait
 *
 * A run of the policy HOLD is hold() (hold.py): a holder that is not a task. It takes the key or
 * gives up (LockHeld, wait=0), computes no result, and at its release sends the runs joined to it
 * to run themselves (run/settle.py, rerun_joined) instead of answering them.
 *
 * Abstractions: time is an abstract clock: a lease expires by an event (the clock passing its
 * deadline), allowed when its holder died or paused (a live holder's heartbeat renews in time);
 * the server clock read by fences counts up one per grant (TIME never goes back); tokens are
 * small numbers (a run's attempts, hand-off tokens and the sweeper's call ids share one counter).
 *
 * Faults, each a nondeterministic choice with a budget: a script's reply is lost and the client
 * sends the same call again (LOSSES), a whole worker dies between two steps of a run (DEATHS;
 * nobody takes over what it owed), a holder pauses past its TTL and wakes (PAUSES), a
 * reservation's run is slow to come (SLOW), Redis restarts from an older snapshot or empty
 * (RESTORES).
 *
 * Properties (assertions; the end check runs at quiescence through `timeout`):
 *   P1 at most SLOTS holders whose leases have not run out, while Redis keeps its data
 *   P2 every grant's fence is larger than every earlier grant's, across restores
 *   P3 the resource refuses a write fenced older than one it accepted (Kleppmann's case)
 *   P4 every run ends terminal: nothing parked, joined, pending or handed on is lost
 *   P5 no run's body runs twice, unless a lease of it ran out unreleased (its worker died or
 *      froze past its TTL: it may run again, as a broker's redelivery would; fences order them)
 *   P6 a holder that learned it was superseded writes nothing more; a superseded run never
 *      writes after its successor wrote (P3)
 *   P7 coalesce: at most one pending run (queue entries not yet handed a slot), and only the
 *      latest-sent run becomes pending
 *
 * Seeded faults (each removes one safeguard; the checker must find a counterexample):
 *   NO_FENCE_CHECK   FENCED_SET stores any fence (P3: the paused holder overwrites)
 *   NO_RELEASE_GUARD RELEASE forgets its replay guard (rt, by, settled) (P4: joined runs lost)
 *   NO_FENCE_CLOCK   fences are last + 1 only, without the clock (P2: reissued after a restore)
 *   NO_REPLACE       COALESCE leaves the pending run it replaces in the queue (P7)
 *   NO_ADOPTED       ACQUIRE forgets which parked runs adopted their slot (P5: a copy runs again)
 *   NO_ONE_RESERVATION a hand-on reserves a second slot for a run whose reservation ran out
 *                    (P5: each copy of its message adopts one, the run runs twice); checked with
 *                    NO_ADOPTED_FIRST, as ACQUIRE's taken_before (also before it adopts a
 *                    reservation, and holds_elsewhere: lease/acquire.lua:42-45) covers it too
 *   NO_ADOPTED_FIRST ACQUIRE looks at taken_before only when no reservation is there to adopt
 *   NO_MARKS         the recovery ignores the journal marks and trusts the epoch alone
 *                    (worker/recovery.py:242-252 Recovery._lost; shared/common.lua `journaled`)
 *                    (P4: a restore from a snapshot taken after a worker's last epoch look loses
 *                    the runs it parked since: the open defect the configuration restore showed)
 *
 * A journal mark is a token: the hand-off token of a PARK or COALESCE, the delivery's token for a
 * JOIN (one wait each); a run's journal line (jnl, lmark) is its last wait's.
 */

#ifndef SLOTS
#define SLOTS 1
#endif
#ifndef RUNS
#define RUNS 3
#endif
#ifndef LOSSES
#define LOSSES 0
#endif
#ifndef DEATHS
#define DEATHS 0
#endif
#ifndef PAUSES
#define PAUSES 0
#endif
#ifndef SLOW
#define SLOW 0
#endif
#ifndef RESTORES
#define RESTORES 0
#endif
#ifndef OLDER
#define OLDER 1             /* a restore may bring back an older snapshot (else: empty only) */
#endif
#ifndef IGNORE_RESULT
#define IGNORE_RESULT 0     /* the task keeps no result state (nothing to read at a hand-off) */
#endif
#ifndef RETRIES
#define RETRIES 1
#endif
/* policies */
#define QUEUE 1
#define JOIN 2
#define COALESCE 3
#define SUPERSEDE 4
#define SKIP 5
#define RETRY 6
#define HOLD 7
#ifndef P0
#define P0 QUEUE
#endif
#ifndef P1
#define P1 JOIN
#endif
#ifndef P2
#define P2 QUEUE
#endif
#define POLICY(r) ((r) == 0 -> P0 : ((r) == 1 -> P1 : P2))

#define NOBODY 255
#ifndef NTOK
#define NTOK 32             /* tokens 1..NTOK-1; 0: none */
#endif
#define BIT(r) (1 << (r))

/* replies (named as in the protocol's reply classes) */
mtype = { ACQUIRED, HELD, HANDED_ON, ADOPTED, RELEASED, NOT_OURS, FREE, PARKED, JOINED, PENDING, GIVES_WAY, STALE, STARTED, RENEWED, RENEWED_SUPERSEDED, GONE };

/* a run's outcome (its result state), terminal from DONE on */
#define O_SENT 0
#define O_RUNNING 1
#define O_WAITING 2     /* QUEUED, JOINED or pending: it waits in Redis */
#define O_DONE 3        /* its body ran and it ended */
#define O_TURNED 4      /* skip, raise, retries spent, gives way, stale */
#define O_ANSWERED 5    /* joined: the holder's result; coalesced: replaced by a newer run */
#define O_LOST 6        /* its worker died during its run (WorkerLostError, RunLost) */
#define TERMINAL(o) ((o) >= O_DONE)

typedef Rec {
  byte tok;     /* the lease's token (a run's attempt, or the hand-off token of a reservation); 0 none */
  byte tid;     /* task id on the slot (holder, reserved or last run); NOBODY: no record */
  byte fence;
  bit res;      /* a reservation for a parked run */
  bit exp;      /* the clock passed its deadline */
  bit waiting;  /* runs wait: its release hands the key on */
  bit joined;   /* runs joined it */
  bit sup;      /* superseded */
  byte rt;      /* the token of the release that ended the slot's last run (RELEASE's replay guard) */
  byte by;      /* reservation: who made it (it sends the message) */
  int lost;     /* fences of leases that ran out unreleased (a bit per fence) */
}

typedef Redis {
  Rec s[SLOTS];
  byte q[RUNS];       /* the queue: entries 'id|hand-off token', here the token */
  byte qlen;
  byte ptok[RUNS];    /* parked messages: task id -> the hand-off token its message carries (0: none) */
  byte j[RUNS];       /* joined runs */
  byte jlen;
  byte settled[NTOK]; /* release token -> the joined runs it took (a bit per task id) */
  bit taken[NTOK];    /* settled 'a:<token>': not yet made sure answered by a sweeper */
  byte adopted[NTOK]; /* ADOPTED: hand-off token -> fence of the run that adopted its slot (0: none) */
  byte latest;        /* newest book 'latest': stamp of the latest-sent pending or started run */
  byte owed[RUNS];    /* newest book 'o:<id>': runs replaced by id, not answered yet */
  int marks;          /* 'journaled': the journal marks of runs that began to wait (a bit per token) */
  bit life;           /* the epoch: life and count */
  byte count;
}

Redis R;            /* the lease Redis */
Redis S;            /* a snapshot of it */
bit snapped;

/* the world beside Redis (ghost state, never restored) */
byte clock;               /* the server's clock as fences read it */
byte maxfence;            /* largest fence granted */
byte resource;            /* the fenced resource's stored fence */
byte out[RUNS];           /* each run's result state */
byte ran[RUNS];           /* bodies started */
byte lostrun[RUNS];       /* bodies that ended with their worker */
bit ranout[RUNS];         /* a lease of the run ran out unreleased (its worker died or froze) */
bit sawsup[RUNS];         /* the run learned it was superseded */
bit inbody[RUNS];
bit lapsed[RUNS];         /* its lease ran out (the clock passed it) while in its body */
bit holding[NTOK];        /* the token's run holds its lease and renews it (from its take to its release) */
bit gone[NTOK];           /* the worker using this token died */
bit paused[NTOK];
byte ntok = 1;
byte owner[NTOK];         /* token -> task id */
byte tries[RUNS];
byte losses = LOSSES, deaths = DEATHS, pauses = PAUSES, slow = SLOW, restores = RESTORES;
bit restored;
byte lastpark[RUNS];      /* the hand-off token of the run's last park (its journal line has it) */
byte owes[RUNS];          /* a joined run taken by a release: that release's token, until it answers */
bit jnl[RUNS];            /* the journal of the worker node that parked, joined or made it pending */
#if RESTORES > 0
byte lmark[RUNS];         /* the mark its journal line carries */
/* a script that makes a run wait adds its call's journal mark; the line written after it carries it */
#define MARK(t) R.marks = R.marks | (1 << (t))
#define LINE(r, t) jnl[r] = 1; lmark[r] = t
#else                     /* Redis keeps its data: every mark stays until its line goes (not modelled) */
#define MARK(t) skip
#define LINE(r, t) jnl[r] = 1
#endif
#ifdef NO_MARKS
bit late[RUNS];           /* its journal line was written within LATE_LINE_GRACE after a loss */
bit lossseen;             /* the recovery saw a loss (it remembers when) */
#endif
bit seenlife;             /* the journal's worker: epoch at its last look */
byte seencount;
#if RESTORES > 0
byte looks = 2;
#else
byte looks = 0;
#endif

/* scratch of the indivisible steps (not part of the state) */
hidden byte i, k, e, fs, hd, nf, tmp, pend, mn;
hidden byte busy, adopting, wt, stop;
hidden int lst;

inline NEWTOKEN(t, who) { d_step { t = ntok; owner[t] = who; ntok++; assert(ntok < NTOK) } }
#define LIVE(x) (R.s[x].tok != 0 && !R.s[x].exp)
#define PARKED_HAS(r) (R.ptok[r] != 0)
#define JOINED_HAS(r) ((R.jlen > 0 && R.j[0] == (r)) || (R.jlen > 1 && R.j[1] == (r)) || (R.jlen > 2 && R.j[2] == (r)))

/* hand_off (handoff.lua): give free slot `sl` to the first parked run; `by` sends its message;
   `mine`: the asking run's own entry (hand-off token) if it is parked (its turn: nothing is
   handed on). Sets hd to the token of the message to send, or 0. */
inline HAND_OFF(sl, maker, mine) {
  hd = 0; k = 0; stop = 0;
  do
  :: stop == 0 && k < R.qlen ->
     e = R.q[k];
     if
     :: e == mine -> stop = 1
     :: else ->
        busy = 0;
        for (i : 0 .. SLOTS - 1) {
          /* reserved on another slot (live, or run out: it waits for that one), or holding one */
#ifndef NO_ONE_RESERVATION
          if :: i != sl && R.s[i].tok == e && (LIVE(i) || R.s[i].res) -> busy = 1 :: else -> skip fi
#else
          if :: i != sl && R.s[i].tok == e && LIVE(i) -> busy = 1 :: else -> skip fi
#endif
        }
        if
        :: busy -> k++
        :: !busy && PARKED_HAS(owner[e]) ->
           lst = R.s[sl].lost;
           if :: R.s[sl].tok != 0 && !R.s[sl].res && R.s[sl].exp -> lst = lst | (1 << R.s[sl].fence) :: else -> skip fi;
           R.s[sl].lost = lst; R.s[sl].tok = e; R.s[sl].tid = owner[e]; R.s[sl].res = 1; R.s[sl].by = maker;
           R.s[sl].exp = 0; R.s[sl].waiting = 1; R.s[sl].sup = 0;
           hd = R.ptok[owner[e]]; stop = 1
        :: else -> /* an entry without its message cannot run */
           tmp = k; do :: tmp + 1 < R.qlen -> R.q[tmp] = R.q[tmp + 1]; tmp++ :: else -> break od;
           R.qlen--; R.q[R.qlen] = 0
        fi
     fi
  :: else -> break
  od
}

inline QREMOVE(r) {
  k = 0;
  do
  :: k < R.qlen && R.q[k] != r -> k++
  :: k < R.qlen && R.q[k] == r ->
     do :: k + 1 < R.qlen -> R.q[k] = R.q[k + 1]; k++ :: else -> break od;
     R.qlen--; R.q[R.qlen] = 0; break
  :: else -> break
  od
}

/* ACQUIRE looks at taken_before also when a reservation is there to adopt (NO_ADOPTED_FIRST: only
   when none is) */
#ifndef NO_ADOPTED_FIRST
#define TAKEN_BEFORE_LOOKED 1
#else
#define TAKEN_BEFORE_LOOKED (!adopting)
#endif

/* ACQUIRE (acquire.lua). In: me (token), r (task id), h (hand-off token or 0).
   Out: rep; fence, slot (ACQUIRED); other (HANDED_ON: the run to send, or NOBODY) */
inline ACQUIRE(me, r, h, rep, fence, slot, other) {
  d_step {
    rep = 0; fs = NOBODY; adopting = 0; wt = 0;
    for (i : 0 .. SLOTS - 1) {
      if
      :: rep == 0 && R.s[i].tok == me ->    /* this call ran before: answer as it did */
         R.s[i].exp = 0; rep = ACQUIRED; fence = R.s[i].fence; slot = i
      :: rep == 0 && R.s[i].res && R.s[i].by == me ->
         rep = HANDED_ON; other = R.ptok[R.s[i].tid]
      :: else -> skip
      fi;
      if :: R.s[i].waiting -> wt = 1 :: else -> skip fi
    }
    if
    :: rep == 0 && h != 0 ->
       for (i : 0 .. SLOTS - 1) {
         if :: fs == NOBODY && R.s[i].res && R.s[i].tok == h -> fs = i; adopting = 1 :: else -> skip fi
       }
#ifndef NO_ADOPTED
       if
       :: TAKEN_BEFORE_LOOKED && R.adopted[h] != 0 ->     /* taken_before (lease/lease.lua holds_elsewhere) */
          tmp = 1;
          for (i : 0 .. SLOTS - 1) {
            if
            :: (R.s[i].lost & (1 << R.adopted[h])) != 0 -> tmp = 0
            :: R.s[i].tok != 0 && !R.s[i].res && R.s[i].fence == R.adopted[h] -> tmp = 0   /* a reservation carries the fence before it */
            :: else -> skip
            fi
          }
          /* or, adopting a reservation, that lease still holds another slot */
          for (i : 0 .. SLOTS - 1) {
            if :: adopting && i != fs && LIVE(i) && !R.s[i].res && R.s[i].fence == R.adopted[h] -> tmp = 1 :: else -> skip fi
          }
          if :: tmp -> rep = ADOPTED :: else -> skip fi
       :: else -> skip
       fi
#endif
    :: else -> skip
    fi;
    if
    :: rep == 0 && fs == NOBODY ->
       for (i : 0 .. SLOTS - 1) {
         if :: fs == NOBODY && !LIVE(i) -> fs = i :: else -> skip fi
       }
       if
       :: SLOTS > 1 ->     /* a task id already running on one slot must not take another */
          for (i : 0 .. SLOTS - 1) {
            if :: LIVE(i) && R.s[i].tid == r -> rep = HELD :: else -> skip fi
          }
       :: else -> skip
       fi;
       if
       :: rep == 0 && fs == NOBODY -> rep = HELD
       :: rep == 0 && fs != NOBODY && wt ->
          HAND_OFF(fs, me, h);
          if
          :: hd != 0 -> rep = HANDED_ON; other = hd
          :: else -> wt = (R.qlen > 0)
          fi
       :: else -> skip
       fi
    :: else -> skip
    fi;
    if
    :: rep == HELD ->
       other = NOBODY;
       for (i : 0 .. SLOTS - 1) { if :: LIVE(i) && R.s[i].tid == r -> other = r :: else -> skip fi }
    :: else -> skip
    fi;
    if
    :: rep == 0 ->
       if
       :: h != 0 -> QREMOVE(h); R.ptok[r] = 0; wt = (R.qlen > 0)
       :: else -> skip
       fi;
       nf = 0;
       for (i : 0 .. SLOTS - 1) { if :: R.s[i].fence >= nf -> nf = R.s[i].fence + 1 :: else -> skip fi }
#ifndef NO_FENCE_CLOCK
       if :: clock + 1 > nf -> nf = clock + 1 :: else -> skip fi;
#endif
       if :: nf > clock -> clock = nf :: else -> skip fi;
       if :: h != 0 -> R.adopted[h] = nf :: else -> skip fi;
       if
       :: R.s[fs].tok != 0 && !R.s[fs].res && R.s[fs].exp && !adopting ->
          R.s[fs].lost = R.s[fs].lost | (1 << R.s[fs].fence)
       :: else -> skip
       fi;
       if :: !adopting -> R.s[fs].sup = 0 :: else -> skip fi;
       R.s[fs].tok = me; R.s[fs].tid = r; R.s[fs].fence = nf; R.s[fs].res = 0; R.s[fs].exp = 0;
       R.s[fs].waiting = wt; R.s[fs].by = 0;
       rep = ACQUIRED; fence = nf; slot = fs;
       /* P2 */
       assert(nf > maxfence); maxfence = nf
    :: else -> skip
    fi
  }
}

/* RELEASE (release.lua). In: me, r, slot, fence. Out: rep; other (the run handed the key, or
   NOBODY); answered (joined runs taken, a bit per task id) */
inline RELEASE(me, r, slot, fence, rep, other, answered) {
  d_step {
    other = 0; answered = 0;
    if
    :: R.s[slot].tok != me ->
       rep = NOT_OURS;
#ifndef NO_RELEASE_GUARD
       if
       :: R.s[slot].rt == me || (R.s[slot].res && R.s[slot].by == me) ->   /* this call ran before */
          rep = RELEASED; answered = R.settled[me];
          if :: R.s[slot].res && R.s[slot].by == me -> other = R.ptok[R.s[slot].tid] :: else -> skip fi
       :: R.s[slot].rt != me && !(R.s[slot].res && R.s[slot].by == me) && R.settled[me] != 0 ->
          rep = RELEASED; answered = R.settled[me]
       :: (R.s[slot].rt != me && !(R.s[slot].res && R.s[slot].by == me) && R.settled[me] == 0 &&
           (R.s[slot].lost & (1 << fence)) == 0 && R.s[slot].fence > fence) ->
          rep = RELEASED   /* released by this run earlier; a newer run has the record now */
       :: else -> skip
       fi;
#endif
       if
       :: rep == NOT_OURS && R.s[slot].tid == NOBODY ->   /* Redis lost the key: record the end */
          R.s[slot].tid = r; R.s[slot].fence = fence
       :: else -> skip
       fi
    :: else ->
       R.s[slot].tok = 0; R.s[slot].rt = me; rep = RELEASED;
       if
       :: R.s[slot].joined ->
          for (i : 0 .. RUNS - 1) { if :: i < R.jlen -> answered = answered | BIT(R.j[i]); R.j[i] = 0 :: else -> skip fi }
          R.jlen = 0; R.settled[me] = answered; R.taken[me] = 1; R.s[slot].joined = 0;
          for (i : 0 .. RUNS - 1) { if :: (answered & BIT(i)) != 0 -> owes[i] = me :: else -> skip fi }
       :: else -> skip
       fi;
       if
       :: R.s[slot].waiting ->
          HAND_OFF(slot, me, 0);
          other = hd;
          if :: hd == 0 && R.qlen == 0 -> R.s[slot].waiting = 0 :: else -> skip fi
       :: else -> skip
       fi
    fi
  }
}

/* RENEW (renew.lua) */
inline RENEW(me, slot, rep) {
  d_step {
    if
    :: R.s[slot].tok == me && !R.s[slot].res ->
       R.s[slot].exp = 0; rep = (R.s[slot].sup -> RENEWED_SUPERSEDED : RENEWED)
    :: else -> rep = GONE
    fi
  }
}

inline ALL_HELD(x) {
  x = 1; for (i : 0 .. SLOTS - 1) { if :: !LIVE(i) -> x = 0 :: else -> skip fi }
}

/* PARK (park.lua) */
inline PARK(r, t, rep) {
  d_step {
    ALL_HELD(tmp);
    if
    :: R.adopted[t] != 0 || PARKED_HAS(r) -> rep = PARKED  /* it parked before (and may have run since) */
    :: else ->
       if
       :: !tmp -> rep = FREE
       :: else ->
          R.q[R.qlen] = t; R.qlen++; R.ptok[r] = t; MARK(t);
          for (i : 0 .. SLOTS - 1) { R.s[i].waiting = 1 }
          rep = PARKED
       fi
    fi
  }
}

/* JOIN (join.lua; one slot); mk: the journal mark */
inline JOIN_(r, mk, rep) {
  d_step {
    busy = 0;
    for (i : 0 .. RUNS - 1) { if :: i < R.jlen && R.j[i] == r -> busy = 1 :: else -> skip fi }
    /* taken by any release or sweep still kept (its ANSWERED mark), not only the last release */
    for (i : 0 .. NTOK - 1) { if :: (R.settled[i] & BIT(r)) != 0 -> busy = 1 :: else -> skip fi }
    if
    :: !LIVE(0) && !busy -> rep = FREE
    :: else ->
       if :: !busy -> R.j[R.jlen] = r; R.jlen++; MARK(mk) :: else -> skip fi;
       if :: LIVE(0) -> R.s[0].joined = 1 :: else -> skip fi;
       rep = JOINED
    fi
  }
}

/* COALESCE (coalesce.lua), mode 'last' or 'supersede'. Out: rep; replaced (a bit per task id) */
inline COALESCE_(r, t, sup_mode, rep, replaced) {
  d_step {
    replaced = 0;
    ALL_HELD(tmp);
    if
    :: R.adopted[t] != 0 -> rep = PENDING; replaced = R.owed[r]   /* it ran before, and the run took its slot since */
    :: R.adopted[t] == 0 && PARKED_HAS(r) -> rep = PENDING; replaced = R.owed[r]
    :: R.adopted[t] == 0 && !PARKED_HAS(r) && R.latest > r + 1 -> rep = GIVES_WAY   /* a newer run is pending or started: before FREE */
    :: R.adopted[t] == 0 && !PARKED_HAS(r) && !(R.latest > r + 1) && !tmp -> rep = FREE
    :: else ->
       pend = 0;
       for (k : 0 .. RUNS - 1) {
         if
         :: k < R.qlen ->
            busy = 0;
            for (i : 0 .. SLOTS - 1) { if :: R.s[i].tok == R.q[k] -> busy = 1 :: else -> skip fi }
            if :: !busy -> pend = R.q[k] :: else -> skip fi
         :: else -> skip
         fi
       }
       if
       :: pend != 0 && owner[pend] > r -> rep = GIVES_WAY    /* the pending run was sent after this one */
       :: else ->
          if
          :: pend != 0 ->
             e = owner[pend];
             replaced = R.owed[e] | (PARKED_HAS(e) -> BIT(e) : 0);
#ifndef NO_REPLACE
             QREMOVE(pend); R.ptok[e] = 0; R.owed[e] = 0;
#endif
             R.owed[r] = replaced
          :: else -> skip
          fi;
          assert(r + 1 >= R.latest);   /* P7: only the latest-sent run becomes pending */
          R.q[R.qlen] = t; R.qlen++; R.ptok[r] = t; R.latest = r + 1; MARK(t);
          for (i : 0 .. SLOTS - 1) {
            R.s[i].waiting = 1;
            if :: sup_mode -> R.s[i].sup = 1 :: else -> skip fi
          }
          rep = PENDING;
          /* P7: at most one pending run (entries not yet handed a slot) */
          tmp = 0;
          for (k : 0 .. RUNS - 1) {
            if
            :: k < R.qlen ->
               busy = 0;
               for (i : 0 .. SLOTS - 1) { if :: R.s[i].tok == R.q[k] -> busy = 1 :: else -> skip fi }
               if :: !busy -> tmp++ :: else -> skip fi
            :: else -> skip
            fi
          }
          assert(tmp <= 1)
       fi
    fi
  }
}

/* NEWEST_START (start.lua). Out: rep; replaced */
inline NEWEST_START(r, rep, replaced) {
  d_step {
    replaced = R.owed[r];
    if
    :: R.latest > r + 1 -> rep = STALE
    :: else -> R.latest = r + 1; rep = STARTED
    fi
  }
}

/* the caller ends the runs it replaced (their result: coalesced into this one), then deletes 'o:<id>' */
inline ANSWER_REPLACED(r, replaced) {
  d_step {
    for (i : 0 .. RUNS - 1) {
      if :: (replaced & BIT(i)) != 0 && !TERMINAL(out[i]) -> out[i] = O_ANSWERED :: else -> skip fi
    }
    R.owed[r] = 0
  }
}

/* FENCED_SET (fenced_set.lua) at the resource */
inline FENCED_SET(r, fence) {
  d_step {
    assert(!sawsup[r]);   /* P6 */
#ifdef NO_FENCE_CHECK
    assert(fence >= resource); resource = fence   /* P3: no write older than one accepted */
#else
    if :: fence >= resource -> resource = fence :: else -> skip fi
#endif
  }
}

/* the run's state is STARTED as it takes its lease (policies.lostruns; the journal's recovery
   looks at a line twice, a compaction apart, before it counts a run gone from Redis as lost) */
inline STARTS(r) {
  if :: rep == ACQUIRED && !TERMINAL(out[r]) -> out[r] = O_RUNNING :: else -> skip fi;
  if :: rep == ACQUIRED -> holding[me] = 1 :: else -> skip fi
}

inline WAITS(r) {
  if :: !TERMINAL(out[r]) -> out[r] = O_WAITING :: else -> skip fi
}

/* the run's own copy of a parked run's message, sent by whoever was handed it */
inline SEND(p) {
  if :: p != 0 -> printf("  sends run %d's message (hand-off token %d)\n", owner[p], p); run Run(owner[p], p, 0) :: else -> skip fi
}

inline COUNT_HOLDERS() {
  tmp = 0; for (i : 0 .. RUNS - 1) { if :: inbody[i] && !lapsed[i] -> tmp++ :: else -> skip fi }
  assert(restored || tmp <= SLOTS)   /* P1 */
}

/* a whole worker dies: nobody takes over what it owed */
#define DIE(state) d_step { deaths > 0; deaths--; gone[me] = 1; holding[me] = 0; \
  if :: out[r] == O_SENT || out[r] == O_RUNNING -> out[r] = O_LOST :: else -> skip fi; state }; \
  printf("run %d: its worker dies\n", r); goto done

proctype Run(byte r; byte h; bit recovered) {
  mtype rep;
  byte me, ht, fence, slot, other, answered;
  bit learned;
  byte steps;

  /* policies.recovered: a recovered run is dropped if it ran, runs or waits again */
  if :: recovered && out[r] != O_WAITING -> goto done :: else -> skip fi;
acquire: skip;
  atomic {
    NEWTOKEN(me, r);
    ACQUIRE(me, r, h, rep, fence, slot, other);
    printf("run %d token %d: ACQUIRE hand-off %d -> %e fence %d, sends %d\n", r, me, h, rep, fence, other);
    STARTS(r)
  }
  if
  :: atomic { losses > 0 -> losses--; ACQUIRE(me, r, h, rep, fence, slot, other);
     printf("run %d token %d: ACQUIRE again (reply lost) -> %e fence %d, sends %d\n", r, me, rep, fence, other);
     STARTS(r) }
  :: skip
  fi;
  if
  :: rep == ACQUIRED -> goto running
  :: rep == ADOPTED -> goto done      /* another copy of a parked run that took its slot */
  :: rep == HANDED_ON ->
     if :: DIE(skip) :: skip fi;
     SEND(other); goto duplicate
  :: rep == HELD && other == r ->
     /* a redelivery of a running task (duplicates.turn_away_redelivery): its own copy waits at
        the front and is dropped at that run's release; if that run's worker dies, the run ends
        LOST (and may run again, as a redelivery would) */
     goto done
  :: rep == HELD && other != r -> goto duplicate
  fi;
duplicate: skip;
  if
  :: POLICY(r) == SKIP || POLICY(r) == HOLD -> out[r] = O_TURNED; goto done   /* a hold: LockHeld (wait=0) */
  :: POLICY(r) == RETRY ->
     atomic {
       if
       :: tries[r] < RETRIES -> tries[r]++; run Run(r, 0, 0)
       :: else -> out[r] = O_TURNED
       fi
     }
     goto done
  :: POLICY(r) == QUEUE ->
     /* QUEUED is stored before the run is parked (once parked it may run and end at any moment) */
     atomic { NEWTOKEN(ht, r); lastpark[r] = ht; WAITS(r); PARK(r, ht, rep); printf("run %d: PARK token %d -> %e\n", r, ht, rep) }
     if :: atomic { losses > 0 -> losses--; PARK(r, ht, rep); printf("run %d: PARK again (reply lost) -> %e\n", r, rep) } :: skip fi;
     if
     :: rep == FREE -> goto acquire
     :: else -> d_step { LINE(r, ht) }; goto done   /* its journal line, after it parked */
     fi
  :: POLICY(r) == JOIN ->
     atomic { WAITS(r); JOIN_(r, me, rep); printf("run %d: JOIN -> %e\n", r, rep) }
     if :: atomic { losses > 0 -> losses--; JOIN_(r, me, rep); printf("run %d: JOIN again (reply lost) -> %e\n", r, rep) } :: skip fi;
     if
     :: rep == FREE -> goto acquire
     :: else -> d_step { LINE(r, me) }; goto done   /* its journal line, after it joined */
     fi
  :: POLICY(r) == COALESCE || POLICY(r) == SUPERSEDE ->
     atomic { NEWTOKEN(ht, r); lastpark[r] = ht; WAITS(r); COALESCE_(r, ht, POLICY(r) == SUPERSEDE, rep, answered);
              printf("run %d: COALESCE token %d -> %e replaced %d\n", r, ht, rep, answered) }
     if
     :: atomic { losses > 0 -> losses--; COALESCE_(r, ht, POLICY(r) == SUPERSEDE, rep, answered);
                 printf("run %d: COALESCE again (reply lost) -> %e replaced %d\n", r, rep, answered) }
     :: skip
     fi;
     if
     :: rep == FREE -> goto acquire
     :: rep == GIVES_WAY -> out[r] = O_TURNED; goto done
     :: rep == PENDING ->
        d_step { LINE(r, ht) };
        if :: DIE(skip) :: skip fi;
        ANSWER_REPLACED(r, answered); goto done
     fi
  fi;
running: skip;
  if
  :: h != 0 && out[r] == O_DONE && !IGNORE_RESULT ->
     /* policies.recovered: a hand-off of a run that succeeded already is not run again (an older
        snapshot brought its parked entry back) */
     printf("run %d: handed the key, but it succeeded already: not run again\n", r);
     goto release
  :: else -> skip
  fi;
  d_step {
    /* P5: a body runs once, unless an earlier one was lost with its worker */
    ran[r]++; assert(ran[r] <= 1 || ranout[r]);
    out[r] = O_RUNNING; inbody[r] = 1; lapsed[r] = 0;
    COUNT_HOLDERS()
  }
  if
  :: POLICY(r) == COALESCE || POLICY(r) == SUPERSEDE ->
     atomic { NEWEST_START(r, rep, answered); printf("run %d: NEWEST_START -> %e\n", r, rep) }
     ANSWER_REPLACED(r, answered);
     if :: rep == STALE -> d_step { inbody[r] = 0; ran[r]--; out[r] = O_TURNED }; goto release :: else -> skip fi
  :: else -> skip
  fi;
  /* the body: a fenced write, the heartbeat's renewal, a second write; a pause or the worker's
     death may come between any two of them */
  steps = 0;
  do
  :: steps < 3 ->
     if
     :: atomic { pauses > 0 -> pauses--; paused[me] = 1; printf("run %d: pauses\n", r) }
        /* frozen past its TTL: the clock may pass its deadline and the key change hands */
        atomic { paused[me] = 0; printf("run %d: wakes\n", r) }
     :: DIE(out[r] = O_LOST; lostrun[r]++; inbody[r] = 0)
     :: skip
     fi;
     if
     :: steps == 1 ->
        atomic {
          RENEW(me, slot, rep); printf("run %d: RENEW -> %e\n", r, rep);
          if
          :: rep == GONE || rep == RENEWED_SUPERSEDED -> learned = 1; sawsup[r] = (rep == RENEWED_SUPERSEDED)
          :: else -> lapsed[r] = 0; COUNT_HOLDERS()
          fi
        }
     :: steps != 1 && !learned ->
        atomic { FENCED_SET(r, fence); printf("run %d: FENCED_SET fence %d (resource now %d)\n", r, fence, resource) }
     :: else -> skip
     fi;
     steps++
  :: else -> break
  od;
  skip;
  d_step { inbody[r] = 0; if :: !TERMINAL(out[r]) -> out[r] = O_DONE :: else -> skip fi }
release: skip;
  atomic {
    holding[me] = 0;
    RELEASE(me, r, slot, fence, rep, other, answered);
    printf("run %d token %d: RELEASE -> %e, sends %d, answers %d\n", r, me, rep, other, answered)
  }
  if
  :: atomic { losses > 0 -> losses--; RELEASE(me, r, slot, fence, rep, other, answered);
     printf("run %d token %d: RELEASE again (reply lost) -> %e, sends %d, answers %d\n", r, me, rep, other, answered) }
  :: skip
  fi;
  if :: DIE(skip) :: skip fi;
  atomic {
    SEND(other);
    if
    :: POLICY(r) == HOLD ->
       /* a hold computes no result: the runs joined to it are sent to run themselves, each with a
          rejoin header (a new message, which no release's ANSWERED mark names) */
       steps = 0;
       do
       :: steps < RUNS && (answered & BIT(steps)) != 0 ->
          owes[steps] = 0;
          for (k : 0 .. NTOK - 1) { R.settled[k] = R.settled[k] & ~BIT(steps); S.settled[k] = S.settled[k] & ~BIT(steps) }
          printf("  the hold sends joined run %d to run itself\n", steps);
          run Run(steps, 0, 0); steps++
       :: steps < RUNS && (answered & BIT(steps)) == 0 -> steps++
       :: else -> break
       od
    :: else ->
       for (i : 0 .. RUNS - 1) {
         if :: (answered & BIT(i)) != 0 && !TERMINAL(out[i]) -> out[i] = O_ANSWERED :: else -> skip fi;
         if :: (answered & BIT(i)) != 0 -> owes[i] = 0 :: else -> skip fi
       }
    fi
  }
done: skip;
  d_step { me = 0; ht = 0; fence = 0; slot = 0; other = 0; answered = 0; learned = 0; steps = 0; rep = 0 }
}

#define CAN_EXPIRE(x) (R.s[x].tok != 0 && !R.s[x].exp && \
  ((!R.s[x].res && (!holding[R.s[x].tok] || paused[R.s[x].tok])) || (R.s[x].res && (gone[R.s[x].by] || slow > 0))))


/* the clock passes a deadline: a lease whose holder died or froze, or a reservation whose maker
   died or whose run is slow to come */
inline EXPIRE(x) {
  d_step {
    CAN_EXPIRE(x);
    if :: R.s[x].res && !gone[R.s[x].by] -> slow-- :: else -> skip fi;
    R.s[x].exp = 1; printf("clock: the lease on slot %d (token %d) runs out\n", x, R.s[x].tok);
    for (i : 0 .. RUNS - 1) { if :: !R.s[x].res && R.s[x].tid == i -> lapsed[i] = 1; ranout[i] = 1 :: else -> skip fi }
  }
}
proctype Clock() {
end:
  do
  :: EXPIRE(0)
#if SLOTS > 1
  :: EXPIRE(1)
#endif
  od
}

/* the sweeper (worker/sweeper.py's RESUME, and the journal's recovery: worker/recovery.py) */
#define ENTRY_FREE(k) (k < R.qlen && !(LIVE(0) && R.s[0].tok == R.q[k]) && \
  !(SLOTS > 1 && LIVE(SLOTS - 1) && R.s[SLOTS - 1].tok == R.q[k]))
/* a slot is free, and a parked run could take it (or runs joined a gone holder) */
#define CAN_RESUME ((ENTRY_FREE(0) || ENTRY_FREE(1) || ENTRY_FREE(2) || R.jlen > 0) && \
  (!LIVE(0) || (SLOTS > 1 && !LIVE(SLOTS - 1))))
#define IN_REDIS(r) (PARKED_HAS(r) || JOINED_HAS(r))
/* a journal line to settle: its run no longer waits in Redis, and no live release owes it an answer */
#define UNSETTLED(r) (jnl[r] && !IN_REDIS(r) && (owes[r] == 0 || gone[owes[r]]))

/* a release took joined runs and its worker is gone (the tokens are few: the first ones) */
#define ORPHANED ((R.taken[1] && gone[1]) || (R.taken[2] && gone[2]) || (R.taken[3] && gone[3]) || \
  (R.taken[4] && gone[4]) || (R.taken[5] && gone[5]) || (R.taken[6] && gone[6]) || \
  (R.taken[7] && gone[7]) || (R.taken[8] && gone[8]) || (R.taken[9] && gone[9]) || \
  (R.taken[10] && gone[10]) || (R.taken[11] && gone[11]) || (R.taken[12] && gone[12]))

proctype Sweeper() {
  byte call, other, answered, r;
  bit lost, gone_with;   /* the epoch says data was lost; a run's wait was lost with the data */
end:
  do
  :: atomic { CAN_RESUME -> NEWTOKEN(call, NOBODY) };
     /* RESUME (resume.lua) */
     d_step {
       other = 0; answered = 0;
       fs = NOBODY;
       for (i : 0 .. SLOTS - 1) { if :: fs == NOBODY && !LIVE(i) -> fs = i :: else -> skip fi }
       /* a reservation that ran out first: its run waits for that slot alone */
       for (i : 0 .. SLOTS - 1) { if :: fs != NOBODY && R.s[i].res && R.s[i].exp -> fs = i; break :: else -> skip fi }
       if
       :: fs != NOBODY ->
          if
          :: fs == 0 && SLOTS == 1 ->   /* joined runs of a gone holder are handed back */
             for (i : 0 .. RUNS - 1) { if :: i < R.jlen -> answered = answered | BIT(R.j[i]); R.j[i] = 0 :: else -> skip fi }
             R.jlen = 0; R.s[0].joined = 0; R.settled[call] = answered
          :: else -> skip
          fi;
          HAND_OFF(fs, call, 0); other = hd
       :: else -> skip
       fi
     }
     printf("sweeper: RESUME slot %d -> hands to %d, orphaned joined %d\n", fs, other, answered);
     SEND(other);
     /* orphaned joined runs are sent again: each takes the key or joins anew (with a rejoin
        header of its own: a new message, which no release's ANSWERED mark names) */
     r = 0;
     do
     :: r < RUNS && (answered & BIT(r)) != 0 ->
        d_step { for (k : 0 .. NTOK - 1) { R.settled[k] = R.settled[k] & ~BIT(r); S.settled[k] = S.settled[k] & ~BIT(r) } };
        run Run(r, 0, 0); r++
     :: r < RUNS && (answered & BIT(r)) == 0 -> r++
     :: else -> break
     od;
     skip;
     d_step { call = 0; other = 0; answered = 0; r = 0 }
  :: d_step {
       /* the key's look, ANSWER_GRACE after a release took joined runs: those still waiting
          are answered (worker/sweeper.py _unanswered); a live releaser answers them first */
       ORPHANED;
       for (k : 1 .. NTOK - 1) {
         if
         :: R.taken[k] && gone[k] ->
            for (i : 0 .. RUNS - 1) {
              if :: (R.settled[k] & BIT(i)) != 0 && !TERMINAL(out[i]) -> out[i] = O_ANSWERED :: else -> skip fi
            }
            R.taken[k] = 0
         :: else -> skip
         fi
       }
       printf("sweeper: answers the joined runs a lost releaser took\n")
     }
  :: atomic {
       (looks > 0 || UNSETTLED(0) || (RUNS > 1 && UNSETTLED(1)) || (RUNS > 2 && UNSETTLED(2))) ->
       if :: looks > 0 -> looks-- :: else -> skip fi;
       /* EPOCH: one more look, compared with this worker's last; the journal's reads of Redis
          are confirmed by a look after them (worker/recovery.py settle), so they count as read
          at the look */
       printf("recovery: looks at the epoch\n");
       R.count++;
       lost = (R.life != seenlife || R.count <= seencount);
#ifdef NO_MARKS
       if :: lost -> lossseen = 1 :: else -> skip fi;
#endif
       seenlife = R.life; seencount = R.count;
       r = 0;
       do
       :: r < RUNS ->
          if
          :: UNSETTLED(r) ->
             jnl[r] = 0;
#if !defined(NO_MARKS) && RESTORES > 0
             /* its mark tells, whatever the epoch says: there, the run was handed on (the mark
                goes with the line); gone, Redis lost the data it waited in */
             gone_with = ((R.marks & (1 << lmark[r])) == 0); R.marks = R.marks & ~(1 << lmark[r]); lmark[r] = 0;
#elif RESTORES == 0
             gone_with = 0;   /* Redis keeps its data: the mark is there, and the epoch says intact */
#else
             gone_with = (lost || (lossseen && late[r]));
#endif
             printf("recovery: run %d no longer waits in Redis (epoch says lost: %d; lost: %d)\n", r, lost, gone_with);
             if
             :: gone_with && out[r] == O_WAITING -> run Run(r, lastpark[r], 1)
             :: else -> skip
             fi
          :: else -> skip
          fi;
          r++
       :: else -> break
       od;
       lost = 0; r = 0; gone_with = 0
     }
  od
}

inline COPY_DB(to, from) {
  for (i : 0 .. SLOTS - 1) {
    to.s[i].tok = from.s[i].tok; to.s[i].tid = from.s[i].tid; to.s[i].fence = from.s[i].fence;
    to.s[i].res = from.s[i].res; to.s[i].exp = from.s[i].exp; to.s[i].waiting = from.s[i].waiting;
    to.s[i].joined = from.s[i].joined; to.s[i].sup = from.s[i].sup; to.s[i].rt = from.s[i].rt;
    to.s[i].by = from.s[i].by; to.s[i].lost = from.s[i].lost
  }
  for (i : 0 .. RUNS - 1) {
    to.q[i] = from.q[i]; to.j[i] = from.j[i]; to.ptok[i] = from.ptok[i]; to.owed[i] = from.owed[i]
  }
  for (i : 0 .. NTOK - 1) { to.settled[i] = from.settled[i]; to.adopted[i] = from.adopted[i]; to.taken[i] = from.taken[i] }
  to.qlen = from.qlen; to.jlen = from.jlen; to.latest = from.latest;
  to.life = from.life; to.count = from.count; to.marks = from.marks
}

inline EMPTY_DB() {
  for (i : 0 .. SLOTS - 1) {
    R.s[i].tok = 0; R.s[i].tid = NOBODY; R.s[i].fence = 0; R.s[i].res = 0; R.s[i].exp = 0;
    R.s[i].waiting = 0; R.s[i].joined = 0; R.s[i].sup = 0; R.s[i].rt = 0; R.s[i].by = 0; R.s[i].lost = 0
  }
  for (i : 0 .. RUNS - 1) { R.q[i] = 0; R.j[i] = 0; R.ptok[i] = 0; R.owed[i] = 0 }
  for (i : 0 .. NTOK - 1) { R.settled[i] = 0; R.adopted[i] = 0; R.taken[i] = 0 }
  R.qlen = 0; R.jlen = 0; R.latest = 0; R.count = 0; R.marks = 0
}

/* a run in its body when Redis lost its data lost its lease as if it ran out: it may run again
   (its first body learns it at its next renewal; fences order their writes) */
inline LEASES_GONE() {
  for (i : 0 .. RUNS - 1) {
    if :: inbody[i] || out[i] == O_RUNNING -> ranout[i] = 1 :: else -> skip fi;
#ifdef NO_MARKS
    /* waiting, its journal line not written yet: written after the loss, within the grace */
    if :: out[i] == O_WAITING && !jnl[i] -> late[i] = 1 :: else -> skip fi
#endif
  }
}

/* Redis restarts: from the snapshot (older data), or empty (a new life of the epoch) */
proctype Disaster() {
end:
  do
#if OLDER
  :: restores > 0 && !snapped -> d_step { COPY_DB(S, R); snapped = 1 }; printf("redis: snapshot\n")
  :: restores > 0 && snapped -> d_step { restores--; COPY_DB(R, S); restored = 1; LEASES_GONE() }; printf("redis: restored from the snapshot\n")
#endif
  :: restores > 0 -> d_step { restores--; tmp = R.life; EMPTY_DB(); R.life = !tmp; restored = 1; LEASES_GONE() }; printf("redis: restarted empty\n")
  od
}

init {
  byte r;
  d_step {
    for (i : 0 .. SLOTS - 1) { R.s[i].tid = NOBODY }
    seencount = 0
  }
  atomic {
    run Clock(); run Sweeper();
    if :: RESTORES > 0 -> run Disaster() :: else -> skip fi;
    r = 0;
    do :: r < RUNS -> run Run(r, 0, 0); r++ :: else -> break od
  }
  timeout ->
  /* P4: at quiescence every run ended terminal */
  d_step { for (i : 0 .. RUNS - 1) { assert(TERMINAL(out[i])) } }
}
