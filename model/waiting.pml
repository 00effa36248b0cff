/*
 * The waiting runs of celery_singleflight, for SPIN: what keeps a run that waits outside the
 * lease's own queue from being lost or run twice. Three parts, one per configuration (a define):
 *
 *   DELAYED  a delayed run's copies (run/delay.py, policies/delayed.py, policies/lostruns.py,
 *            worker/copies.py): its countdown message and the copies a sweeper sends, each with a
 *            token, of which one claims the run; worker liveness; the started index
 *   FAIR     the fair gate of a task with fair_concurrency=SLOTS (policies/fair.py,
 *            worker/fairpark.py): enter, reservations, hand-on through the worker's own queue
 *   ORDERED  ordered=True (policies/ordering.py): sequence numbers, the order gate, the skip
 *
 * (hold() is in lease.pml, as the policy HOLD: it is a run of the lease protocol itself.)
 *
 * Each script is one indivisible step (d_step), as Lua is atomic on the server, and takes the
 * decisions its Lua takes (celery_singleflight/protocol/lua/):
 *
 *   DELAY, TOUCH, CLAIM     delayed/delay.lua, delayed/touch.lua, delayed/claim.lua
 *   CLAIM_DONE, RESEND      delayed/done.lua, delayed/resend.lua
 *   ACQUIRE, RELEASE        lease/acquire.lua, lease/release.lua (one slot for DELAYED: a claimant's
 *                           lease taken over by a copy, `earlier`; SLOTS for the gate: a reservation
 *                           adopted, `handoff`, and taken_before)
 *   HAND_OFF, RESUME        handoff/handoff.lua, handoff/resume.lua (the gate's queue; RESUME names
 *                           every holder that died on the gate)
 *   FAIR_ENTER              fair/enter.lua, fair/fair.lua (reserve)
 *   ORDER_GATE, ORDER_ADVANCE, ORDER_SWEEP   order/gate.lua, order/advance.lua, order/sweep.lua
 *                           (ORDER_TAKE: run r has the number r + 1)
 *   LOST                    policies/lostruns.py FailLostRuns with protocol/started.py verdict and,
 *                           for a provisional member (watch_take, before a take), verdict_of
 *
 * Abstractions: time is abstract. A lease runs out only if its holder's worker died or froze, or
 * its delivery ended without its release; a reservation only if no delivery of its run is on its
 * way (the message was lost with its worker), or its run is SLOW. A grace or timeout that waits
 * for a live actor is not cut short unless a SLOW budget says so: a copy nobody noted is sent
 * again only once the workers holding one are gone or frozen (DELAYED_UNSEEN_GRACE), a number is
 * skipped only once none of its messages is on its way (order_timeout), a countdown delayed by a
 * holder's time left comes once that lease is gone, a provisional started-index member is looked
 * at only after its take (it is due a TTL later). A claim is taken back once its claimant is gone
 * or frozen (WORKER_GONE_AFTER, DELAYED_CLAIM_PATIENCE), or ended without saying so. Each delivery
 * runs on a worker: a delayed or ordered delivery on a worker of its own; a fair run handed a slot
 * on the releaser's worker (its own queue). Tokens, workers and lease tokens share one counter
 * (FAIR: ids fixed by what they stand for). A caller's settle() (a dead holder named by the script
 * ended RunLost) is taken in the script's step. A Retry stores RETRY over anything but SUCCESS
 * (Celery's key-value backends keep a SUCCESS). FAIR: a started run lost with its worker is ended
 * at once (its precise member's verdict), and a provisional member's verdict reads no prev_task_id
 * (a replaced holder is named by the replacing script). Not modelled: Redis restores (lease.pml
 * has them, with the journal marks), fair tags and weights (the queue is FIFO here),
 * queue_timeout, debounce and the rate limit themselves (only the delay they make), a run's lock
 * key beside the gate, redis_max_wait (a run re-sent by fail_closed fails once it passed).
 *
 * Faults, each a nondeterministic choice with a budget: a worker dies at any step, with every
 * delivery on it (DEATHS; nobody takes over: the Reaper, each delivery's `unless`); a worker
 * freezes and wakes (PAUSES); a script's reply is lost and the client sends the same call again
 * (LOSSES; a re-delay's DELAY is sent again later, other steps between); a message held by a dead worker comes back after the visibility timeout (LATE); a
 * message is slow (SLOW); the broker delivers a fair message twice (DUPS); an ordered run's
 * message never arrives (MISSING); the start's pipeline (the started index, CLAIM_DONE) fails, or
 * runs and its client sees a Redis error, and then the release may fail too (ERRORS).
 *
 * Properties (assertions; the end check runs at quiescence through `timeout`):
 *   P1 at most SLOTS runs in their bodies at the gate whose leases have not run out
 *   P4 every run ends terminal: nothing delayed, claimed, parked, reserved or waiting for its turn
 *      is lost
 *   P5 no run's body runs twice, unless a lease of it ran out unreleased while it ran (DELAYED:
 *      held by a delivery past its start; FAIR: any)
 *   P8 the lost-run sweeper ends a run RunLost only once a lease of it ran out unreleased (also
 *      between its take and its start: the provisional member), never while a lease of it is live
 *   P9 ordered runs take the lease (or enter the queue) in sequence order, except numbers skipped
 *
 * Seeded faults (each removes one safeguard; the checker must find a counterexample):
 *   NO_CLAIM_OWNER   RESEND never takes a claim back (delayed/resend.lua:38-46, `if e.c then`, the
 *                    claimant's worker alive and patient): a claimant that took its lease and died
 *                    before CLAIM_DONE leaves its run waiting: the issue's reproduction (P4)
 *   NO_TAKE_BACK     CLAIM_DONE answers DONE to a claim taken back (delayed/done.lua:29-31,
 *                    TAKEN_BACK): the woken claimant and the copy both run (P5)
 *   NO_RESEND_ON_ERROR a run whose start's CLAIM_DONE met a Redis error only releases
 *                    (policies/delayed.py:83 started(), retry_later): its copy is done, nothing
 *                    runs it (P4; defect 13)
 *   NO_OWN_ATTEMPT_WAIT a claimant held by its own run's lease is turned away as a redelivery
 *                    (policies/duplicates.py:351-353, wait_for_own_attempt): it parks an own copy
 *                    its stale holder's release drops, or finds the key free: not run (P4; 14)
 *   NO_TOOK_KEPT     a later RESEND forgets `took` (delayed/resend.lua:45-46, claim.lua:34 clears
 *                    it); with NO_OWN_ATTEMPT_WAIT, as either alone covers the window (P4; 14)
 *   NO_LIVE_ATTEMPT  the verdict reads a member whose lease a later attempt took over as LOST
 *                    (protocol/started.py:116-120): a woken claimant's member ends the run RunLost
 *                    while the copy runs it (P8; 15)
 *   NO_ADOPTED_FIRST ACQUIRE looks at taken_before only without a reservation to adopt
 *                    (lease/acquire.lua:42-45, lease/lease.lua holds_elsewhere); alone it is
 *                    covered by NO_RENEWED_RESERVATION's fix, checked with it: FAIR_ENTER reserves
 *                    a second slot beside its run's run-out reservation (fair/enter.lua:38-47):
 *                    both copies run (P5; 16). It also covers NO_GATE_ADOPTED and lease.pml's
 *                    NO_ONE_RESERVATION, each checked with it
 *   NO_PROVISIONAL   no started-index member before a take (policies/lostruns.py:73 watch_take,
 *                    policies/fair.py:175): a worker dying between the gate's take and the run's
 *                    start leaves it QUEUED (P4; 17)
 *   NO_RESERVATION_EXPIRY a reservation never runs out (shared/common.lua:41 `live`, its deadline;
 *                    handoff/resume.lua:71-75 hands a run-out reservation again): a hand-on message
 *                    lost with its worker leaves its run parked (P4)
 *   NO_GATE_ADOPTED  FAIR_ENTER forgets the tokens that took their slot (fair/enter.lua:48, ZSCORE
 *                    adopted): a second copy of a run's message is reserved a slot and runs (P5)
 *   NO_ORDER_SWEEP   no ORDER_SWEEP (policies/ordering.py:182 SkipGaps, order/sweep.lua): a
 *                    predecessor whose message is lost holds its successors for ever (P4)
 *   NO_DELAY_IF_CLAIMED a re-delay by a delayed copy of its key passes no claim
 *                    (run/delay.py:75 delay_again, delayed/delay.lua:31-34 NOT_CLAIMED): a stale
 *                    attempt whose claim was taken back, held by the copy that runs, delays the
 *                    run again, which runs twice (P5; 18)
 *   NO_REPLAY_NOT_CLAIMED a re-delay's DELAY sent again (its reply lost) after a copy claimed the
 *                    run answers DELAYED (delayed/delay.lua:26-28, run/delay.py:83-86 Ignore): the
 *                    sweeper's copy of the new delay ends the run, then the retrying attempt sends
 *                    its countdown message, stale, and stores RETRY over that end (P4; D)
 */

#ifndef RUNS
#define RUNS 2
#endif
#ifndef SLOTS
#define SLOTS 1
#endif
#ifndef DEATHS
#define DEATHS 0
#endif
#ifndef PAUSES
#define PAUSES 0
#endif
#ifndef LOSSES
#define LOSSES 0
#endif
#ifndef LATE
#define LATE 0
#endif
#ifndef SLOW
#define SLOW 0
#endif
#ifndef DUPS
#define DUPS 0
#endif
#ifndef MISSING
#define MISSING 0
#endif
#ifndef ERRORS
#define ERRORS 0
#endif
#ifndef HOLDER
#define HOLDER 0            /* DELAYED: another run (task id 1) takes the key too */
#endif
#ifndef RETRIES
#define RETRIES 1           /* DELAYED with HOLDER: a held delayed run is delayed again (retry) this often */
#endif

#define NOBODY 255
#define NTOK 30             /* ids 1..NTOK-1 (bits of an int); 0: none */
#define B(x) (1 << (x))

mtype = { GO, GO_LATE, STALE, DONE, TAKEN_BACK, ACQUIRED, HELD, HANDED_ON, ADOPTED, ADMITTED, PARKED,
          WAIT, LATE_TURN, ANOTHER_DELIVERY, REDIS_ERROR, NOT_CLAIMED };

/* a run's outcome (its result state), terminal from DONE on */
#define O_SENT 0
#define O_RUNNING 1
#define O_WAITING 2     /* delayed (RETRY, DEBOUNCED), QUEUED at the gate, PENDING for its turn */
#define O_DONE 3        /* its body ran and it ended */
#define O_TURNED 4      /* retries spent, LockHeld, its message never came */
#define O_LOST 6        /* FAILURE: RunLost, WorkerLostError (lost with its worker) */
#define TERMINAL(o) ((o) >= O_DONE)

byte ntok = RUNS + 1;     /* 1..RUNS: the fair tokens of the runs' messages (FAIR) */
int gone;                 /* workers that died */
int paused;               /* workers frozen (a sweeper sees them gone, and their claims past patience) */
int alive;                /* workers with a delivery in progress: the Reaper's choice */
byte deaths = DEATHS, pauses = PAUSES, losses = LOSSES, late = LATE, slow = SLOW, dups = DUPS;
byte missing = MISSING, rerrors = ERRORS;

/* the world beside Redis (ghost state) */
byte out[RUNS];
byte ran[RUNS];           /* bodies started */
bit ranout[RUNS];         /* a lease of the run ran out unreleased while it ran */

hidden byte i, k, e, fs, hd, tmp, busy, stop, adopting, wt;
hidden byte lostlive;     /* P8: a run ended RunLost while a lease of it is live */

inline NEWID(x) { x = ntok; ntok++; assert(ntok < NTOK) }
inline WAITS(r) { if :: !TERMINAL(out[r]) -> out[r] = O_WAITING :: else -> skip fi }
/* Celery's Retry stores RETRY, over anything but SUCCESS (a key-value backend keeps a SUCCESS) */
inline RETRY_STATE(r) { if :: out[r] != O_DONE -> out[r] = O_WAITING :: else -> skip fi }

/* a worker dies at any step: every delivery on it stops (its `unless`), nobody takes over */
#define KILL(x) :: d_step { deaths > 0 && (alive & ~gone & B(x)) != 0 -> deaths--; gone = gone | B(x); \
                   printf("worker %d dies\n", x) }
proctype Reaper() {
end:
  do
  KILL(1) KILL(2) KILL(3) KILL(4) KILL(5) KILL(6) KILL(7) KILL(8) KILL(9) KILL(10) KILL(11) KILL(12)
  KILL(13) KILL(14) KILL(15) KILL(16) KILL(17) KILL(18) KILL(19) KILL(20) KILL(21) KILL(22) KILL(23)
  KILL(24) KILL(25) KILL(26) KILL(27) KILL(28) KILL(29)
  od
}

/* a worker freezes (past its TTL, past DELAYED_CLAIM_PATIENCE) and wakes */
inline PAUSE(w) {
  if
  :: atomic { pauses > 0 -> pauses--; paused = paused | B(w); printf("worker %d freezes\n", w) }
     atomic { paused = paused & ~B(w); printf("worker %d wakes\n", w) }
  :: skip
  fi
}

#ifdef DELAYED
/* ================================ delayed copies ================================ */

/* the key's one slot, its run record (a delivery's lease token is its worker) */
byte ltok;                /* token: the lease (or the own copy's reservation) holding it; 0: released or none */
byte lf;                  /* fence: the lease token that wrote it (a reservation keeps the one before it) */
byte ltid = NOBODY;       /* task id */
bit lexp;
bit lres;                 /* a reservation, for the own copy (ltok: its hand-off id) */
byte lpt = NOBODY;        /* prev_task_id: who held it before this record */
bit lpx;                  /* prev_outcome is `expired` (that lease ran out unreleased) */
int lostm;                /* `lost`: fences of leases that ran out unreleased, replaced not by a take-over */
int inrun;                /* lease tokens whose delivery passed its start (CLAIM_DONE answered DONE) */
/* an own copy (duplicates.turn_away_redelivery), only with NO_OWN_ATTEMPT_WAIT: a delivery held by
   a lease of its own run parks its message at the front of the key's queue; it runs only if that
   lease ends unreleased */
byte oc, octook;          /* its message: the delayed token and the lease to take over it carries; 0: none */
byte och;                 /* its entry's hand-off id */
byte ocad, ocadh;         /* 'adopted': the lease token that took a reservation, and its hand-off id */

/* run 0's entry in the key's `delayed` hash */
bit dex;                  /* there is one */
byte dt;                  /* t: the token last handed out */
int dts;                  /* ts: this delay's tokens */
int dold;                 /* old: stale tokens (earlier delays, claims taken back) */
bit dm;                   /* m: the message, kept until the claimant says done */
byte dmt;                 /* ... the lease to take over its headers carry (the delaying delivery's) */
bit dr;                   /* r: a sweeper sent a copy */
byte dc, downer, dlt;     /* c, o, lt: the claim, its worker, the lease token it will take */
int dw;                   /* w: the workers noted holding a copy (TOUCH) */
byte dtook;               /* took: the lease token a re-sent copy takes over */
/* the started index: members of run 0 */
int stm;                  /* [key, slot, id, fence, worker]: the fences (lease tokens) of its starts */
int pvm;                  /* provisional [key, -1, id, 0, worker], entered before a take: the workers */

/* ghosts */
int unseen;               /* workers holding a copy they have not noted nor claimed */
int claiming;             /* claimants that have not yet told CLAIM_DONE */
byte occoming;            /* deliveries of the own copy on their way to its reservation */
byte back, backtook, backh; /* a message a dead worker held, coming back after the visibility timeout */
byte tries;
byte dwo;                 /* the lease the current delay's countdown waits out (wait_for_own_attempt) */

#define HAS_TOKEN(t) ((dts & B(t)) != 0 || dt == (t))
#define SEEN_ALIVE(m) ((m) & ~(gone | paused))
#define LLIVE (ltok != 0 && !lexp)
#define RUN0LIVE (ltok != 0 && !lexp && !lres && ltid == 0)   /* a lease of run 0 holds the slot */

/* a delivery of run 0's message (token t, took, own copy's hand-off id h) to a new worker x */
inline SEND_COPY(t, took, h, x) {
  NEWID(x); alive = alive | B(x); unseen = unseen | B(x);
  if :: h != 0 -> occoming++ :: else -> skip fi;
  run Copy(t, took, h, x); x = 0
}

/* DELAY (delay.lua): the run delayed (again) under token t0, its message carrying took0 */
inline DELAY(t0, took0) {
  dold = dold | dts | (dt != 0 -> B(dt) : 0); dold = dold & ~B(t0);
  dex = 1; dt = t0; dts = B(t0); dm = 1; dmt = took0; dr = 0; dc = 0; downer = 0; dlt = 0; dw = 0; dtook = 0;
  dwo = 0
}

/* DELAY again by a delayed copy of its key that claimed token t (delay_again passes that claim,
   for every re-delay: wait_for_own_attempt, retry): written under a new token only while its
   claim stands (claimed by t, or not claimed with t current: a copy the recovery put back, not
   modelled here), else NOT_CLAIMED, nothing written, and it raises Ignore. Out: t0 (0: none) */
inline REDELAY(t, t0, took0, rep) {
#ifndef NO_DELAY_IF_CLAIMED
  if :: dex && ((dc != 0 && dc != t) || (dc == 0 && !HAS_TOKEN(t))) -> rep = NOT_CLAIMED
     :: else -> NEWID(t0); DELAY(t0, took0); rep = 0
  fi
#else
  NEWID(t0); DELAY(t0, took0); rep = 0
#endif
}

/* the same DELAY sent again by redis-py (its reply lost; t0 its token): a token the entry knows
   is this call's own write (here always: an entry a re-delay wrote stays), answered as it was,
   unless a copy of the run claimed it meanwhile: NOT_CLAIMED, nothing written (Ignore) */
inline REDELAY_AGAIN(t0, rep) {
  assert(dex && (HAS_TOKEN(t0) || (dold & B(t0)) != 0 || dc == t0));
#ifndef NO_REPLAY_NOT_CLAIMED
  rep = ((dc != 0 && dc != t0) -> NOT_CLAIMED : 0)
#else
  rep = 0
#endif
}

/* delay_again's caller, answered: Ignore, or its countdown message sent and RETRY stored */
inline REDELAYED(w, t0, took0, rep, x) {
  if
  :: rep == NOT_CLAIMED -> printf("worker %d: DELAY -> NOT_CLAIMED: Ignore\n", w)
  :: else -> RETRY_STATE(0); printf("worker %d: DELAY again, token %d: RETRY\n", w, t0); SEND_COPY(t0, took0, 0, x); t0 = 0
  fi
}

/* its reply lost (LOSSES): the caller waits, other steps between, and redis-py sends it again */
#define REDELAY_LOST(w, t0, took0, rep, x) \
  :: rep != NOT_CLAIMED && losses > 0 -> losses--; printf("worker %d: DELAY again, token %d: its reply is lost\n", w, t0) \
  :: true -> REDELAYED(w, t0, took0, rep, x); goto ended
#define REDELAY_SENT_AGAIN(w, t0, took0, rep, x) \
  atomic { d_step { REDELAY_AGAIN(t0, rep) }; printf("worker %d: DELAY token %d sent again\n", w, t0); \
           REDELAYED(w, t0, took0, rep, x) }

/* TOUCH (touch.lua) */
inline TOUCH(t, w) {
  d_step {
    if :: dex && dc == 0 && HAS_TOKEN(t) -> dw = dw | B(w) :: else -> skip fi;
    unseen = unseen & ~B(w); printf("worker %d: TOUCH token %d\n", w, t)
  }
}

/* CLAIM (claim.lua): the claimant's worker and lease token are w; a claim clears `took` */
inline CLAIM(t, w, rep) {
  if
  :: !dex -> rep = GO
  :: dex && dc != 0 && dc == t -> rep = (dr -> GO_LATE : GO)
  :: dex && dc != 0 && dc != t ->   /* dropped: made stale, so that a late TOUCH of it holds nothing */
     if :: HAS_TOKEN(t) -> dts = dts & ~B(t); dold = dold | B(t) :: else -> skip fi;
     rep = STALE
  :: dex && dc == 0 && !HAS_TOKEN(t) -> rep = STALE
  :: else -> dc = t; downer = w; dlt = w; dw = 0; dtook = 0; rep = (dr -> GO_LATE : GO)
  fi
}

/* CLAIM_DONE (done.lua) */
#define BACK_TAKEN(t) ((dc != 0 && dc != (t)) || (dc == 0 && !HAS_TOKEN(t)))
inline CLAIM_DONE(t, rep) {
  if
  :: !dex -> rep = DONE
  :: dex && BACK_TAKEN(t) ->
#ifndef NO_TAKE_BACK
     rep = TAKEN_BACK
#else
     rep = DONE
#endif
  :: dex && !BACK_TAKEN(t) && !dm -> rep = DONE
  :: dex && !BACK_TAKEN(t) && dm && !dr && dold == 0 ->
     dex = 0; dt = 0; dts = 0; dm = 0; dmt = 0; dc = 0; downer = 0; dlt = 0; dw = 0; dtook = 0; rep = DONE
  :: else -> dc = t; dm = 0; dmt = 0; dw = 0; downer = 0; dlt = 0; rep = DONE
  fi
}

/* RESEND (resend.lua) would send a copy (else NOT_DUE or GONE: nothing changes, nothing is sent) */
#ifndef NO_CLAIM_OWNER
#define TAKE_BACK (dc != 0 && SEEN_ALIVE(claiming & B(downer)) == 0)
#else
#define TAKE_BACK 0
#endif
#define RESEND_DUE (dex && dm && (TAKE_BACK || \
  (dc == 0 && SEEN_ALIVE(dw) == 0 && (dw != 0 || SEEN_ALIVE(unseen) == 0 || slow > 0))))

/* out: took, the lease the copy takes over (HEADER_EARLIER: `took`, else its message's own) */
inline RESEND(t, took) {
  if
  :: dc != 0 ->   /* taken back: the claimant's token is stale from now on */
     dts = dts & ~B(dc); dold = dold | B(dc); dtook = dlt; dc = 0; downer = 0; dlt = 0
  :: else ->
#ifdef NO_TOOK_KEPT
     dtook = 0;   /* a later copy forgets the taken-back claimant's lease */
#endif
     if :: dw == 0 && SEEN_ALIVE(unseen) != 0 -> slow-- :: else -> skip fi   /* a live holder slow to note */
  fi;
  dr = 1; dt = t; dw = 0; dts = dts | B(t); took = (dtook != 0 -> dtook : dmt)
}

/* a record replaces the slot's: who held it before and how that ended (common.lua previous: a
   reservation passes on what it was told) */
inline PREV() {
  if
  :: lres -> skip
  :: !lres && ltok != 0 -> lpt = ltid; lpx = lexp
  :: else -> lpt = ltid; lpx = 0
  fi
}

/* the own copy's entry gets the free slot: a reservation (hand_off, keeping the fence); a lease
   that ran out unreleased there is lost, and named if not run 0's */
inline RESERVE_OWN(dead) {
  if :: ltok != 0 && lexp && !lres -> lostm = lostm | B(lf); if :: ltid != 0 -> dead = ltid :: else -> skip fi
     :: else -> skip fi;
  PREV(); ltok = och; ltid = 0; lres = 1; lexp = 0
}

/* taken_before (handoff.lua): the own copy h took its slot, and that lease was not lost */
#define TAKEN_BEFORE(h) (h != 0 && h == ocadh && (lostm & B(ocad)) == 0 && !(ltok == ocad && !lres))

/* ACQUIRE (acquire.lua), one slot: earlier, the lease a re-sent copy takes over; h, the own
   copy's hand-off id its delivery adopts. Out: rep; dead (a holder whose lease ran out
   unreleased, replaced: the caller ends it); HELD: dead is the holder's task id */
inline ACQUIRE(me, r, earlier, h, rep, dead) {
  dead = NOBODY; rep = 0;
  if :: ltok == me && !lres -> rep = ACQUIRED :: else -> skip fi   /* sent again */
#ifndef NO_ADOPTED_FIRST
  ; if :: rep == 0 && TAKEN_BEFORE(h) -> rep = ADOPTED :: else -> skip fi
#endif
  ; if
  :: rep == 0 && ((h != 0 && lres && ltok == h) || (earlier != 0 && ltok == earlier && !lres)) ->
     /* adopting the reservation made for it, or taking the claimant's lease over: not lost */
     PREV(); if :: h != 0 && lres -> oc = 0; och = 0; ocad = me; ocadh = h :: else -> skip fi;
     ltok = me; lf = me; ltid = r; lexp = 0; lres = 0; rep = ACQUIRED
  :: rep == 0 && !((h != 0 && lres && ltok == h) || (earlier != 0 && ltok == earlier && !lres)) ->
#ifdef NO_ADOPTED_FIRST
     if :: TAKEN_BEFORE(h) -> rep = ADOPTED :: else -> skip fi;
#endif
     if
     :: rep != 0 -> skip
     :: rep == 0 && LLIVE -> rep = HELD; dead = ltid
     :: rep == 0 && !LLIVE && oc != 0 && h != och -> RESERVE_OWN(dead); rep = HANDED_ON   /* the own copy waits first */
     :: rep == 0 && !LLIVE && !(oc != 0 && h != och) ->
        if :: ltok != 0 && lexp && !lres -> lostm = lostm | B(lf); if :: ltid != r -> dead = ltid :: else -> skip fi
           :: else -> skip fi;
        PREV();
        if :: h != 0 && h == och -> oc = 0; och = 0; ocad = me; ocadh = h :: else -> skip fi;   /* leaving the queue */
        ltok = me; lf = me; ltid = r; lexp = 0; lres = 0; rep = ACQUIRED
     fi
  :: else -> skip
  fi
}

/* RELEASE (release.lua): out, the own copy handed the slot (0: none) */
inline RELEASE(me, r, handed) {
  d_step {
    handed = 0;
    if
    :: ltok == me && !lres ->
       ltok = 0;
       if
       :: oc != 0 && r == 0 -> oc = 0; och = 0    /* drop_own_copy: its run ended */
       :: oc != 0 && r != 0 -> RESERVE_OWN(e); handed = oc
       :: else -> skip
       fi
    :: else ->   /* NOT_OURS: the run ended all the same: its own copy is dropped unless handed a slot */
       if :: oc != 0 && r == 0 && !(lres && !lexp) -> oc = 0; och = 0 :: else -> skip fi
    fi;
    printf("worker %d: RELEASE (hands the own copy on: %d)\n", me, handed)
  }
}

/* settle(): a holder whose lease ran out unreleased, replaced, is ended (RunLost) */
inline END_DEAD(dead) {
  d_step {
    if :: dead != NOBODY && !TERMINAL(out[dead]) -> out[dead] = O_LOST; printf("  ends dead holder run %d\n", dead)
       :: else -> skip fi;
    dead = NOBODY
  }
}

/* PARK of an own copy (park.lua): only while a lease of its run holds the slot; one per task id */
inline PARK_OWN(t, took, rep) {
  if
  :: !LLIVE || lres || ltid != 0 -> rep = HELD     /* FREE: "released meanwhile", not run */
  :: LLIVE && !lres && ltid == 0 && oc != 0 -> rep = PARKED
  :: else -> oc = t; octook = took; NEWID(och); rep = PARKED
  fi
}

/* one delivery, on worker w, of run 0's message carrying token t (and took: HEADER_EARLIER); h:
   the hand-off id of the own copy it is (its reservation to adopt), 0 if none */
proctype Copy(byte t; byte took; byte h; byte w) {
  byte dead = NOBODY, nt, x, handed, held;
  mtype rep;
  bit started;    /* the task started (its message acknowledged): it claimed */
  bit coming = (h != 0);   /* on its way to the own copy's reservation */
  printf("worker %d receives token %d (takes over %d, own copy %d)\n", w, t, took, h);
  {
    if :: TOUCH(t, w) :: skip fi;
    /* a countdown of wait_for_own_attempt comes once the lease it waits out is gone */
    (t != dt || dwo == 0 || !(ltok == dwo && LLIVE));
    PAUSE(w);
    atomic { d_step { CLAIM(t, w, rep); unseen = unseen & ~B(w); started = 1;
                      if :: rep != STALE -> claiming = claiming | B(w) :: else -> skip fi };
             printf("worker %d: CLAIM token %d -> %e\n", w, t, rep) }
    if
    :: atomic { losses > 0 -> losses--; d_step { CLAIM(t, w, rep) }; printf("worker %d: CLAIM again (reply lost) -> %e\n", w, rep) }
    :: skip
    fi;
    if :: rep == STALE -> goto fin :: else -> skip fi;
    PAUSE(w);
    /* watch_take (the started index, provisional), then ACQUIRE */
    atomic { d_step { pvm = pvm | B(w); ACQUIRE(w, 0, took, h, rep, dead); if :: coming -> occoming--; coming = 0 :: else -> skip fi;
                      if :: rep == HELD -> held = ltok :: else -> skip fi };
             printf("worker %d: ACQUIRE earlier %d own copy %d -> %e\n", w, took, h, rep) }
    if :: rep != HELD -> END_DEAD(dead) :: else -> skip fi;
    if
    :: rep == ADOPTED -> goto ended                 /* a copy of its own copy that ran: dropped */
    :: rep == HANDED_ON -> atomic { SEND_COPY(oc, octook, och, x) }; goto ended   /* then held by it */
    :: rep == HELD && dead == 0 ->                  /* held by its own run */
#ifndef NO_OWN_ATTEMPT_WAIT
       /* wait_for_own_attempt: delayed again by that lease's time left (its headers go along) */
       atomic { d_step { REDELAY(t, nt, took, rep); if :: rep != NOT_CLAIMED -> dwo = held :: else -> skip fi };
                printf("worker %d: held by its own run's lease %d\n", w, held);
                if REDELAY_LOST(w, nt, took, rep, x) fi }
       REDELAY_SENT_AGAIN(w, nt, took, rep, x);
#else
       /* turn_away_redelivery */
       atomic { d_step { PARK_OWN(t, took, rep) }; printf("worker %d: PARK own copy -> %e\n", w, rep) }
#endif
       goto ended
#if HOLDER
    :: rep == HELD && dead == 1 && tries < RETRIES ->   /* retry: delayed again, a new countdown message */
       atomic { d_step { REDELAY(t, nt, took, rep); if :: rep != NOT_CLAIMED -> tries++ :: else -> skip fi };
                printf("worker %d: held by run 1: retry\n", w);
                if REDELAY_LOST(w, nt, took, rep, x) fi }
       REDELAY_SENT_AGAIN(w, nt, took, rep, x);
       goto ended
    :: rep == HELD && dead == 1 && tries >= RETRIES ->   /* retries spent: LockHeld (FAILURE) */
       d_step { out[0] = O_TURNED; printf("worker %d: held by run 1, retries spent: LockHeld\n", w) }; goto ended
#endif
    :: rep == ACQUIRED -> skip
    fi;
    PAUSE(w);
    /* its start (on_start): the started index (the member, its provisional one dropped), then
       CLAIM_DONE, in one pipeline */
    if
    :: atomic { rerrors > 0 -> rerrors--; rep = REDIS_ERROR; printf("worker %d: the start's pipeline fails before Redis runs it\n", w) }
    :: atomic { d_step { stm = stm | B(w); pvm = pvm & ~B(w); CLAIM_DONE(t, rep); if :: rep == DONE -> inrun = inrun | B(w) :: else -> skip fi };
                printf("worker %d: started; CLAIM_DONE -> %e\n", w, rep) }
       if
       :: atomic { losses > 0 -> losses--; d_step { CLAIM_DONE(t, rep); if :: rep == DONE -> inrun = inrun | B(w) :: else -> skip fi };
                   printf("worker %d: CLAIM_DONE again (reply lost) -> %e\n", w, rep) }
       :: atomic { rerrors > 0 -> rerrors--; rep = REDIS_ERROR; inrun = inrun & ~B(w); printf("worker %d: CLAIM_DONE ran, its client saw a Redis error\n", w) }
       :: skip
       fi
    fi;
    d_step { claiming = claiming & ~B(w) };
    if
    :: rep == REDIS_ERROR ->
#ifndef NO_RESEND_ON_ERROR
       /* started(): retry_later, with the same token, taking this lease over (RETRY) */
       atomic { d_step { RETRY_STATE(0) }; printf("worker %d: sent again (token %d, takes over %d)\n", w, t, w);
                SEND_COPY(t, w, 0, x) }
#endif
       if
       :: goto release
       :: printf("worker %d: its release fails too\n", w); goto fin
       fi
    :: rep == TAKEN_BACK -> goto release     /* Ignore: it never starts */
    :: else -> skip
    fi;
    d_step {
      /* P5: a body runs once, unless a lease of the run ran out while it ran */
      ran[0]++; assert(ran[0] <= 1 || ranout[0]);
      out[0] = O_RUNNING; printf("worker %d: run 0's body\n", w)
    }
    PAUSE(w);
    d_step { out[0] = O_DONE }   /* its own result, also over a RunLost written meanwhile */
release:
    RELEASE(w, 0, handed);
    goto fin;
ended: /* finish: the run ended before it started */
    atomic { d_step { CLAIM_DONE(t, rep); claiming = claiming & ~B(w) }; printf("worker %d: CLAIM_DONE (ended) -> %e\n", w, rep) }
fin: skip;
    d_step { alive = alive & ~B(w); claiming = claiming & ~B(w) }
  } unless {
    (gone & B(w)) != 0 ->
    atomic {
      alive = alive & ~B(w); unseen = unseen & ~B(w); claiming = claiming & ~B(w);
      if :: coming -> occoming-- :: else -> skip fi;
      if   /* unacknowledged (it had not started), the message comes back after the visibility timeout */
      :: !started && late > 0 -> late--; back = t; backtook = took; backh = h
      :: else -> skip
      fi
    }
  };
  /* an ended process keeps its place until those after it end: its locals are cleared */
  d_step { t = 0; took = 0; h = 0; w = 0; dead = 0; nt = 0; x = 0; handed = 0; held = 0; rep = 0; started = 0; coming = 0 }
}

/* the other run (task id 1), not delayed: it takes the key once */
proctype Holder() {
  byte w, dead = NOBODY, nt, handed;
  mtype rep;
  d_step { NEWID(w); alive = alive | B(w) }
  {
    atomic { d_step { ACQUIRE(w, 1, 0, 0, rep, dead) }; printf("worker %d: run 1 ACQUIRE -> %e\n", w, rep) }
    if :: rep != HELD -> END_DEAD(dead) :: else -> skip fi;
    if
    :: rep == HANDED_ON -> atomic { SEND_COPY(oc, octook, och, nt); out[1] = O_TURNED }; goto fin
    :: rep == HELD -> out[1] = O_TURNED; goto fin
    :: else -> skip
    fi;
    d_step { inrun = inrun | B(w); ran[1]++; out[1] = O_RUNNING; printf("worker %d: run 1's body\n", w) }
    PAUSE(w);
    d_step { out[1] = O_DONE };
    RELEASE(w, 1, handed);
    if :: handed != 0 -> atomic { SEND_COPY(handed, octook, och, nt) } :: else -> skip fi;
fin: skip;
    d_step { alive = alive & ~B(w) }
  } unless {
    (gone & B(w)) != 0 -> d_step { alive = alive & ~B(w); if :: out[1] == O_SENT || out[1] == O_RUNNING -> out[1] = O_LOST :: else -> skip fi }
  };
  d_step { w = 0; dead = 0; nt = 0; handed = 0; rep = 0 }
}

/* the clock passes a deadline: a lease whose holder's worker died or froze, or whose delivery
   ended without its release; the own copy's reservation when no delivery of it is on its way, or
   it is slow */
proctype Clock() {
end:
  do
  :: d_step {
       ltok != 0 && !lexp && !lres && (((gone | paused) & B(ltok)) != 0 || (alive & B(ltok)) == 0) ->
       lexp = 1; if :: (inrun & B(ltok)) != 0 -> ranout[ltid] = 1 :: else -> skip fi;
       printf("clock: the lease (token %d) runs out\n", ltok)
     }
  :: d_step {
       ltok != 0 && !lexp && lres && (occoming == 0 || slow > 0) ->
       if :: occoming != 0 -> slow-- :: else -> skip fi;
       lexp = 1; printf("clock: the own copy's reservation runs out\n")
     }
  od
}

/* the lost-run sweep (started.py), for run 0. verdict of a member with fence k: a lease of run 0
   holds the slot: live (the member's own, or with the fix a later attempt that took it over) */
#ifndef NO_LIVE_ATTEMPT
#define MEMBER_LIVE(k) RUN0LIVE
#define STARTED_DUE (stm != 0 && !RUN0LIVE)
#else
#define MEMBER_LIVE(k) (RUN0LIVE && lf == (k))
#define STARTED_DUE ((stm & ~(RUN0LIVE -> B(lf) : 0)) != 0)
#endif
/* verdict_of a provisional member: a record of run 0 holding a token (a lease or a reservation) */
#define PROV_LIVE (ltid == 0 && ltok != 0 && !lexp)
#define PROV_DUE (pvm != 0 && !PROV_LIVE)
/* LOST: FAILURE RunLost unless its result is ready. P8: only once a lease of it ran out unreleased,
   never while a lease of it is live (a copy that took it over runs it) */
inline RUN_LOST(what) {
  if
  :: tmp && !TERMINAL(out[0]) ->
     lostlive = RUN0LIVE; assert(!lostlive);   /* P8 */
     out[0] = O_LOST; printf("sweeper: run 0 (%d %d) is lost: RunLost\n", what, k)
  :: else -> skip
  fi
}

/* any worker's sweeper: RESEND of a delayed run due, the lost-run sweep of the started index,
   RESUME of the own copy (the key is in the waiting index) */
proctype Sweeper() {
  byte call, took, x, dead = NOBODY;
end:
  do
  :: atomic {
       RESEND_DUE -> d_step { NEWID(call); RESEND(call, took) };
       printf("sweeper: RESEND token %d (takes over lease %d)\n", call, took);
       if
       :: TERMINAL(out[0]) ->   /* send_copy: the run ended (its result is ready): the copy is dropped */
          d_step { CLAIM_DONE(call, e) }; printf("sweeper: run 0 ended, the copy is dropped\n")
       :: !TERMINAL(out[0]) && deaths > 0 -> deaths--; printf("sweeper: its worker dies before it sends the copy\n")
       :: !TERMINAL(out[0]) -> SEND_COPY(call, took, 0, x)
       fi;
       call = 0; took = 0
     }
  :: d_step {
       STARTED_DUE ->   /* a member (a start, fence k) whose lease is not live */
       k = 1; do :: k < NTOK && ((stm & B(k)) == 0 || MEMBER_LIVE(k)) -> k++ :: else -> break od;
       if
       :: lf == k && !lres && ltid == 0 -> tmp = (ltok != 0)   /* its record: released, or ran out */
       :: else ->
          if
          :: lpt == 0 -> tmp = lpx                             /* replaced: how it ended */
          :: else -> tmp = ((lostm & B(k)) != 0)               /* `lost` */
          fi
       fi;
       RUN_LOST(1); stm = stm & ~B(k); k = 0; tmp = 0
     }
  :: d_step {
       PROV_DUE ->      /* a provisional member (worker k): run 0 on the slot, or who held it before */
       k = 1; do :: k < NTOK && (pvm & B(k)) == 0 -> k++ :: else -> break od;
       if
       :: ltid == 0 && ltok != 0 -> tmp = !lres             /* ran out: a lease is lost, a reservation not */
       :: ltid != 0 && lpt == 0 -> tmp = lpx
       :: else -> tmp = 0                                   /* ended, or it never held the key */
       fi;
       RUN_LOST(0); pvm = pvm & ~B(k); k = 0; tmp = 0
     }
  :: atomic {
       oc != 0 && !LLIVE ->       /* RESUME: the slot is free (its holder died), the own copy waits */
       d_step { RESERVE_OWN(dead) }; printf("sweeper: RESUME hands the slot to the own copy\n");
       END_DEAD(dead);
       if
       :: deaths > 0 -> deaths--; printf("sweeper: its worker dies before it sends\n")
       :: SEND_COPY(oc, octook, och, x)
       fi
     }
  :: atomic { back != 0 -> printf("broker: token %d comes back\n", back); SEND_COPY(back, backtook, backh, x);
              back = 0; backtook = 0; backh = 0 }
  od
}

init {
  byte t0, x;
  d_step { NEWID(t0); DELAY(t0, 0); out[0] = O_WAITING; printf("run 0 delayed, countdown message token %d\n", t0) }
  atomic {
    run Reaper(); run Clock(); run Sweeper(); SEND_COPY(t0, 0, 0, x);
#if HOLDER
    run Holder()
#endif
  }
  timeout ->
  /* P4: at quiescence every run ended terminal */
  d_step { for (i : 0 .. RUNS - 1) { assert(TERMINAL(out[i])) } }
}
#endif

#ifdef FAIR
/* ================================ the fair gate ================================ */

typedef Slot {
  byte tok;     /* a lease's token, or the fair token of the run a reservation is for; 0: none */
  byte tid;     /* task id */
  byte wk;      /* the holder's worker */
  bit res;      /* a reservation */
  bit exp;      /* the clock passed its deadline */
  bit waiting;  /* runs wait: its release hands the slot on */
}
Slot s[SLOTS];
byte q[RUNS];             /* the gate's queue: entries 'task id|fair token', here the token (run + 1) */
byte qlen;
int parkedm;              /* parked messages (a bit per task id) */
byte adopted[RUNS];       /* 'adopted': the run's fair token -> the lease token that took its slot */
int lostm;                /* lease tokens that ran out unreleased, replaced */
int bodym;                /* lease tokens of runs in their bodies, not run out (P1) */
byte coming[RUNS];        /* deliveries of the run on their way to take a reservation */
int sentm;                /* runs whose message was delivered (the broker may deliver it again) */
hidden int namedm;        /* the task ids of holders whose lease ran out unreleased, named by a script */
int pvw[RUNS];            /* the started index: provisional members [gate, -SLOTS, id, 0, worker] of each run (workers) */

/* a lease that ran out unreleased is replaced: lost, and its holder named (not the taking run's own) */
inline REPLACED(x, r) {
  if
  :: s[x].tok != 0 && !s[x].res && s[x].exp ->
     lostm = lostm | B(s[x].tok); if :: s[x].tid != r -> namedm = namedm | B(s[x].tid) :: else -> skip fi
  :: else -> skip
  fi
}
/* settle(): each named holder's run ends (RunLost), unless it ended */
inline END_NAMED() {
  if
  :: namedm != 0 ->
     for (i : 0 .. RUNS - 1) {
       if :: (namedm & B(i)) != 0 && !TERMINAL(out[i]) -> out[i] = O_LOST; printf("  ends dead holder run %d\n", i)
          :: else -> skip fi
     }
     namedm = 0
  :: else -> skip
  fi
}

#define TOKF(r) ((r) + 1)
#define RUN_OF(t) ((t) - 1)
/* ids fixed by what they stand for, not by the order of events (fewer states): the worker of run
   r's first delivery, of the broker's second one, of one taken from the task's queue (a hand-on by
   the sweeper or a newcomer: a live worker takes it, so another once the first died; DEATHS <= 1);
   the run's n-th lease token */
#define W_FIRST(r) (RUNS + 1 + (r))
#define W_DUP(r) (2 * RUNS + 1 + (r))
#define W_QUEUE(r) ((gone & B(3 * RUNS + 1 + (r))) == 0 -> 3 * RUNS + 1 + (r) : 4 * RUNS + 1 + (r))
#define LEASE_TOKEN(r, n) (5 * RUNS + 1 + 4 * (r) + (n))
byte ntake[RUNS];         /* takes of each run so far (its lease tokens) */
#define LIVE(x) (s[x].tok != 0 && !s[x].exp)

/* hand_off (handoff.lua): free slot sl to the first parked run not reserved or running elsewhere;
   mine: the asking run's own entry. Sets hd to the fair token handed, or 0. */
inline HAND_OFF(sl, mine) {
  hd = 0; k = 0; stop = 0;
  do
  :: stop == 0 && k < qlen ->
     e = q[k];
     if
     :: e == mine -> stop = 1
     :: else ->
        busy = 0;
        for (i : 0 .. SLOTS - 1) {
          if :: i != sl && s[i].tok == e && (s[i].res || LIVE(i)) -> busy = 1 :: else -> skip fi
        }
        if
        :: busy -> k++
        :: !busy && (parkedm & B(RUN_OF(e))) != 0 ->
           REPLACED(sl, RUN_OF(e));
           s[sl].tok = e; s[sl].tid = RUN_OF(e); s[sl].res = 1; s[sl].exp = 0; s[sl].waiting = 1; s[sl].wk = 0;
           hd = e; stop = 1
        :: else ->   /* an entry without its message cannot run */
           tmp = k; do :: tmp + 1 < qlen -> q[tmp] = q[tmp + 1]; tmp++ :: else -> break od;
           qlen--; q[qlen] = 0
        fi
     fi
  :: else -> break
  od
}

inline QREMOVE(t) {
  k = 0;
  do
  :: k < qlen && q[k] != t -> k++
  :: k < qlen && q[k] == t ->
     do :: k + 1 < qlen -> q[k] = q[k + 1]; k++ :: else -> break od;
     qlen--; q[qlen] = 0; break
  :: else -> break
  od
}

/* FAIR_ENTER (enter.lua). Out: rep (ADMITTED, PARKED), slot (NOBODY: it took a slot before) */
inline FAIR_ENTER(r, w, rep, slot) {
  rep = 0; slot = NOBODY;
  for (i : 0 .. SLOTS - 1) {
#ifndef NO_RENEWED_RESERVATION
    /* its reservation, also one that ran out (its message was slow): renewed, never a second */
    if :: rep == 0 && s[i].tok == TOKF(r) && (LIVE(i) || s[i].res) -> s[i].exp = 0; rep = ADMITTED; slot = i :: else -> skip fi
#else
    if :: rep == 0 && s[i].tok == TOKF(r) && LIVE(i) -> rep = ADMITTED; slot = i :: else -> skip fi
#endif
  }
#ifndef NO_GATE_ADOPTED
  if :: rep == 0 && adopted[r] != 0 -> rep = ADMITTED :: else -> skip fi;
#endif
  if :: rep == 0 && (parkedm & B(r)) != 0 -> rep = PARKED :: else -> skip fi;
  if
  :: rep == 0 ->
     fs = NOBODY;
     for (i : 0 .. SLOTS - 1) { if :: fs == NOBODY && !LIVE(i) -> fs = i :: else -> skip fi }
     if
     :: fs != NOBODY && qlen == 0 ->   /* reserve (fair.lua) */
        REPLACED(fs, r);
        s[fs].tok = TOKF(r); s[fs].tid = r; s[fs].res = 1; s[fs].exp = 0; s[fs].waiting = 0; s[fs].wk = 0;
        rep = ADMITTED; slot = fs
     :: else ->                         /* parked at its fair place (QUEUED stored first) */
        q[qlen] = TOKF(r); qlen++; parkedm = parkedm | B(r); WAITS(r);
        for (i : 0 .. SLOTS - 1) { if :: LIVE(i) -> s[i].waiting = 1 :: else -> skip fi }
        rep = PARKED
     fi
  :: else -> skip
  fi
}

/* ACQUIRE (acquire.lua) with handoff = the run's fair token. Out: rep, slot; other (HANDED_ON) */
inline ACQUIRE(me, r, w, rep, slot, other) {
  rep = 0; fs = NOBODY; adopting = 0; wt = 0;
  for (i : 0 .. SLOTS - 1) {
    if :: s[i].waiting -> wt = 1 :: else -> skip fi;
    if :: fs == NOBODY && s[i].res && s[i].tok == TOKF(r) -> fs = i; adopting = 1 :: else -> skip fi
  }
#ifndef NO_ADOPTED_FIRST
  if
  :: adopted[r] != 0 ->    /* taken_before, also when a reservation for it is there to adopt */
     tmp = ((lostm & B(adopted[r])) == 0);
     for (i : 0 .. SLOTS - 1) { if :: s[i].tok == adopted[r] && !s[i].res -> tmp = 0 :: else -> skip fi }
     /* holds_elsewhere (lease.lua): that lease still holds another slot */
     for (i : 0 .. SLOTS - 1) { if :: adopting && i != fs && s[i].tok == adopted[r] && !s[i].res && LIVE(i) -> tmp = 1 :: else -> skip fi }
     if :: tmp -> rep = ADOPTED :: else -> skip fi; tmp = 0
  :: else -> skip
  fi;
#else
  if
  :: !adopting && adopted[r] != 0 ->    /* taken_before, only when there is no reservation to adopt */
     tmp = ((lostm & B(adopted[r])) == 0);
     for (i : 0 .. SLOTS - 1) { if :: s[i].tok == adopted[r] && !s[i].res -> tmp = 0 :: else -> skip fi }
     if :: tmp -> rep = ADOPTED :: else -> skip fi; tmp = 0
  :: else -> skip
  fi;
#endif
  if
  :: rep == 0 && !adopting ->
     for (i : 0 .. SLOTS - 1) { if :: fs == NOBODY && !LIVE(i) -> fs = i :: else -> skip fi }
     if
     :: SLOTS > 1 ->    /* a task id already running on one slot must not take another */
        for (i : 0 .. SLOTS - 1) { if :: LIVE(i) && s[i].tid == r -> rep = HELD :: else -> skip fi }
     :: else -> skip
     fi;
     if
     :: rep == 0 && fs == NOBODY -> rep = HELD
     :: rep == 0 && fs != NOBODY && wt ->
        HAND_OFF(fs, TOKF(r));
        if :: hd != 0 -> rep = HANDED_ON; other = hd :: else -> wt = (qlen > 0) fi
     :: else -> skip
     fi
  :: else -> skip
  fi;
  if
  :: rep == 0 ->
     QREMOVE(TOKF(r)); parkedm = parkedm & ~B(r); wt = (qlen > 0);
     adopted[r] = me;
     if :: !adopting -> REPLACED(fs, r) :: else -> skip fi;
     s[fs].tok = me; s[fs].tid = r; s[fs].wk = w; s[fs].res = 0; s[fs].exp = 0; s[fs].waiting = wt;
     rep = ACQUIRED; slot = fs
  :: else -> skip
  fi
}

/* RELEASE (release.lua). Out: other (the fair token handed the slot, or 0) */
inline RELEASE(me, slot, other) {
  other = 0;
  if
  :: s[slot].tok == me && !s[slot].res ->
     s[slot].tok = 0;
     if
     :: s[slot].waiting ->
        HAND_OFF(slot, 0); other = hd;
        if :: hd == 0 && qlen == 0 -> s[slot].waiting = 0 :: else -> skip fi
     :: else -> skip
     fi
  :: else -> skip    /* NOT_OURS */
  fi
}

/* deliveries on a worker (several: a run handed a slot goes to the releaser's own queue) */
byte onw[5 * RUNS + 1];
inline ON_W(x) { onw[x]++; alive = alive | B(x) }
inline OFF_W(x) { onw[x]--; if :: onw[x] == 0 -> alive = alive & ~B(x) :: else -> skip fi }
/* a delivery of run q's message on worker x (the caller's atomic) */
inline DELIVER(rr, x, handed) {
  ON_W(x); sentm = sentm | B(rr); if :: handed -> coming[rr]++ :: else -> skip fi;
  run Fair(rr, x, handed)
}

/* one delivery of run r's message on worker w; handed: a message sent when a slot was handed to
   it (HEADER_FAIR_WAITED: the main process leaves it to the pool) */
proctype Fair(byte r; byte w; bit handed) {
  byte me, slot, other, attempts;
  mtype rep;
  bit takes = handed;   /* on its way to take a reservation */
  {
    atomic {
      if
      :: !handed ->   /* the worker's main process (worker/fairpark.py) */
         d_step { FAIR_ENTER(r, w, rep, slot); END_NAMED(); if :: rep == ADMITTED -> takes = 1; coming[r]++ :: else -> skip fi };
         printf("worker %d: run %d FAIR_ENTER -> %e slot %d\n", w, r, rep, slot);
         if :: rep == PARKED -> goto fin :: else -> skip fi   /* parked and acknowledged */
      :: else -> skip
      fi
    }
take:
    /* the pool process (policies/fair.py): take the gate, adopting the slot reserved for it */
    atomic {
      d_step {
#ifndef NO_PROVISIONAL
               /* watch_take: a run that waited is entered in the started index before its take */
               if :: handed -> pvw[r] = pvw[r] | B(w) :: else -> skip fi;
#endif
               me = LEASE_TOKEN(r, ntake[r]); ntake[r]++; assert(ntake[r] <= 4); ACQUIRE(me, r, w, rep, slot, other); END_NAMED();
               if :: takes -> takes = 0; coming[r]-- :: else -> skip fi;
#ifndef START_WINDOW
               /* its start follows at once (the lock key, on_start: STARTED, the started index) */
               if :: rep == ACQUIRED -> out[r] = O_RUNNING; pvw[r] = pvw[r] & ~B(w) :: else -> skip fi
#endif
      };
      printf("worker %d: run %d ACQUIRE token %d -> %e slot %d, hands to %d\n", w, r, me, rep, slot, other);
      if
      :: rep == ACQUIRED -> goto start
      :: rep == ADOPTED -> goto fin     /* a copy of a run that took its slot: dropped */
      :: rep == HANDED_ON ->            /* it handed a slot on: that run's message goes to the task's queue */
         DELIVER(RUN_OF(other), W_QUEUE(RUN_OF(other)), 1); other = 0
      :: else -> skip
      fi;
      attempts++
    }
    atomic {
      d_step { FAIR_ENTER(r, w, rep, slot); END_NAMED(); if :: rep == ADMITTED && slot != NOBODY -> takes = 1; coming[r]++ :: else -> skip fi };
      printf("worker %d: run %d FAIR_ENTER (pool) -> %e slot %d\n", w, r, rep, slot);
      if
      :: rep == PARKED -> goto fin
      :: rep == ADMITTED && slot == NOBODY -> goto fin   /* its run holds its slot: this copy is dropped */
      :: rep == ADMITTED && slot != NOBODY && attempts < 2 -> goto take
      :: else -> d_step { takes = 0; coming[r]--; if :: !TERMINAL(out[r]) -> out[r] = O_TURNED :: else -> skip fi }; goto fin   /* LockHeld */
      fi
    }
start:
    atomic { skip; d_step {
      /* on_start: STARTED, and for a run that waited, the started index (the lost-run sweeper;
         its provisional member goes) */
      out[r] = O_RUNNING; pvw[r] = pvw[r] & ~B(w);
      /* P5: a body runs once, unless a lease of the run ran out */
      ran[r]++; assert(ran[r] <= 1 || ranout[r]);
      bodym = bodym | B(me);
      /* P1: at most SLOTS runs in their bodies at the gate whose leases have not run out */
      tmp = 0; for (i : 1 .. NTOK - 1) { if :: (bodym & B(i)) != 0 -> tmp++ :: else -> skip fi };
      assert(tmp <= SLOTS); tmp = 0;
      printf("worker %d: run %d's body\n", w, r)
    } }
    atomic {
      d_step { bodym = bodym & ~B(me); out[r] = O_DONE; RELEASE(me, slot, other) };
      printf("worker %d: run %d RELEASE -> hands to %d\n", w, r, other);
      /* settle: the run handed the slot goes to this worker's own queue (lost if this worker dies) */
      if :: other != 0 -> DELIVER(RUN_OF(other), w, 1) :: else -> skip fi
    }
fin:
    /* an ended process keeps its place until those after it end: its locals are cleared */
    atomic { OFF_W(w); r = 0; w = 0; handed = 0; me = 0; slot = 0; other = 0; attempts = 0; rep = 0; takes = 0 }
  } unless {
    (gone & B(w)) != 0 ->
    /* a run lost with its worker: a fresh one (PENDING), or one that started (the lost-run
       sweeper ends it once its lease runs out); one that waited and has not started is watched by
       its provisional member (the Sweeper's look) */
    d_step {
      OFF_W(w); bodym = bodym & ~B(me);
      if :: takes -> coming[r]-- :: else -> skip fi;
      if :: out[r] == O_SENT || out[r] == O_RUNNING -> out[r] = O_LOST :: else -> skip fi;
      r = 0; w = 0; handed = 0; me = 0; slot = 0; other = 0; attempts = 0; rep = 0; takes = 0
    }
  }
}

/* the clock passes a deadline: a lease whose holder's worker died or froze, or a reservation no
   delivery is on its way to take (or whose run is slow) */
#ifndef NO_RESERVATION_EXPIRY
#define RES_CAN_EXPIRE(x) (coming[s[x].tid] == 0 || slow > 0)
#else
#define RES_CAN_EXPIRE(x) 0
#endif
#define CAN_EXPIRE(x) (s[x].tok != 0 && !s[x].exp && \
  ((!s[x].res && ((gone | paused) & B(s[x].wk)) != 0) || (s[x].res && RES_CAN_EXPIRE(x))))
inline EXPIRE(x) {
  d_step {
    CAN_EXPIRE(x) ->
    if :: s[x].res && coming[s[x].tid] != 0 -> slow-- :: else -> skip fi;
    s[x].exp = 1;
    if :: !s[x].res -> ranout[s[x].tid] = 1; bodym = bodym & ~B(s[x].tok) :: else -> skip fi;
    printf("clock: slot %d (token %d) runs out\n", x, s[x].tok)
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

/* RESUME would hand a slot: one is free, and a reservation ran out or an entry waits unreserved */
#define ENTRY_FREE(k) (k < qlen && !((s[0].tok == q[k] && (s[0].res || LIVE(0))) || \
  (SLOTS > 1 && s[SLOTS - 1].tok == q[k] && (s[SLOTS - 1].res || LIVE(SLOTS - 1)))))
#define RESUME_DUE ((!LIVE(0) || !LIVE(SLOTS - 1)) && \
  ((s[0].res && s[0].exp) || (s[SLOTS - 1].res && s[SLOTS - 1].exp) || ENTRY_FREE(0) || ENTRY_FREE(1) || ENTRY_FREE(2)))

/* the lost-run sweep of a provisional member of run r (started.py verdict_of): the first slot
   whose record is run r's and holds a token: live, look again later; a lease run out: LOST; a
   reservation run out, released, or no trace (replaced: the replacing script named it): ENDED */
#define HOLDS(x, r) (s[x].tid == (r) && s[x].tok != 0)
#define PROV_LIVE(r) ((HOLDS(0, r) && LIVE(0)) || (!HOLDS(0, r) && HOLDS(SLOTS - 1, r) && LIVE(SLOTS - 1)))
#define PROV_LOOK(r) \
  :: d_step { pvw[r] != 0 && !PROV_LIVE(r) -> \
       fs = (HOLDS(0, r) -> 0 : (HOLDS(SLOTS - 1, r) -> SLOTS - 1 : NOBODY)); \
       if \
       :: fs != NOBODY && !s[fs].res && !TERMINAL(out[r]) -> \
          /* P8: RunLost only once a lease of it ran out, never while one of it is live */ \
          for (i : 0 .. SLOTS - 1) { lostlive = (s[i].tid == r && !s[i].res && LIVE(i)); assert(!lostlive) }; \
          out[r] = O_LOST; printf("sweeper: run %d (provisional) is lost: RunLost\n", r) \
       :: else -> skip \
       fi; \
       pvw[r] = pvw[r] & (pvw[r] - 1); fs = NOBODY }

/* the sweeper (worker/sweeper.py HandOn: RESUME, FailLostRuns) and the broker delivering a
   message again */
proctype Sweeper() {
  byte other;
end:
  do
  PROV_LOOK(0)
#if RUNS > 1
  PROV_LOOK(1)
#endif
#if RUNS > 2
  PROV_LOOK(2)
#endif
  :: atomic {
       RESUME_DUE ->
       d_step {
         fs = NOBODY;
         for (i : 0 .. SLOTS - 1) { if :: fs == NOBODY && !LIVE(i) -> fs = i :: else -> skip fi }
         /* a reservation that ran out first: its run waits for that slot alone */
         for (i : 0 .. SLOTS - 1) { if :: s[i].res && s[i].exp -> fs = i; break :: else -> skip fi }
         HAND_OFF(fs, 0); other = hd;
         /* every holder that died on the gate is named, not only the one whose slot it hands on */
         if
         :: hd != 0 ->
            for (i : 0 .. SLOTS - 1) {
              if :: s[i].tok != 0 && !s[i].res && s[i].exp && s[i].tid != NOBODY -> namedm = namedm | B(s[i].tid)
                 :: else -> skip fi
            }
         :: else -> skip
         fi;
         END_NAMED()
       }
       printf("sweeper: RESUME slot %d -> hands to %d\n", fs, other);
       if
       :: other != 0 && deaths > 0 -> deaths--; printf("sweeper: its worker dies before it sends\n")
       :: other != 0 -> DELIVER(RUN_OF(other), W_QUEUE(RUN_OF(other)), 1)
       :: else -> skip
       fi;
       other = 0
     }
  :: atomic { dups > 0 && (sentm & B(0)) != 0 -> dups--; printf("broker: run 0's message again\n"); DELIVER(0, W_DUP(0), 0) }
#if RUNS > 1
  :: atomic { dups > 0 && (sentm & B(1)) != 0 -> dups--; printf("broker: run 1's message again\n"); DELIVER(1, W_DUP(1), 0) }
#endif
  od
}

init {
  byte r;
  d_step { for (i : 0 .. SLOTS - 1) { s[i].tid = NOBODY } }
  atomic {
    run Reaper(); run Clock(); run Sweeper();
    do :: r < RUNS -> DELIVER(r, W_FIRST(r), 0); r++ :: else -> break od
  }
  timeout ->
  /* P4: at quiescence every run ended terminal */
  d_step { for (i : 0 .. RUNS - 1) { assert(TERMINAL(out[i])) } }
}
#endif

#ifdef ORDERED
/* ================================ ordered=True ================================ */

/* the key's order book; sequence numbers are bits 1..RUNS */
byte nxt = 1;             /* 'next' */
byte adm;                 /* 'a': the admitted number (0: none) */
byte admd;                /* ... and its delivery (its worker here) */
int wm;                   /* 'w:<seq>': messages kept of runs waiting for their turn (also the waiting numbers) */
int skm;                  /* 'skipped' */
/* ghosts */
int placed;               /* numbers that took the lease or entered the queue */
byte pendc[RUNS + 1];     /* deliveries of each number on their way to the gate */
#if RUNS > 2
#define PEND ((pendc[1] > 0 -> B(1) : 0) | (pendc[2] > 0 -> B(2) : 0) | (pendc[3] > 0 -> B(3) : 0))
#elif RUNS > 1
#define PEND ((pendc[1] > 0 -> B(1) : 0) | (pendc[2] > 0 -> B(2) : 0))
#else
#define PEND (pendc[1] > 0 -> B(1) : 0)
#endif

/* ORDER_GATE (gate.lua) for number n, delivery d */
inline ORDER_GATE(n, d, rep) {
  if
  :: adm == n && admd == d -> rep = GO
  :: else ->
     if
     :: n < nxt -> rep = ((skm & B(n)) != 0 -> LATE_TURN : ANOTHER_DELIVERY)
     :: n == nxt && adm == n -> rep = ANOTHER_DELIVERY
     :: n == nxt && adm != n -> wm = wm & ~B(n); adm = n; admd = d; rep = GO
     :: n > nxt -> wm = wm | B(n); rep = WAIT   /* its message kept (and its journal mark) */
     fi
  fi
}

/* ORDER_ADVANCE (advance.lua). Out: succ, the number whose message to send (0: none) */
inline ORDER_ADVANCE(n, d, succ) {
  succ = 0;
  if
  :: adm == n && admd == d && (nxt == n || nxt == n + 1) ->
     nxt = n + 1;
     if :: (wm & B(n + 1)) != 0 -> succ = n + 1 :: else -> skip fi
  :: else -> skip   /* skipped meanwhile */
  fi
}

/* ORDER_SWEEP (sweep.lua) acts once order_timeout passed: nothing that could still come for
   these numbers is on its way (or a message is SLOW) */
#define LOWEST(m) ((m) & -(m))
#define SKIPPED_RANGE ((LOWEST(wm) - 1) & ~(B(nxt) - 1))
#define ADMITTED_ALIVE (adm == nxt && adm != 0 && (gone & B(admd)) == 0)
#define SWEEP_RESEND ((wm & B(nxt)) != 0 && ((PEND & B(nxt)) == 0 || slow > 0))
#define SWEEP_SKIP ((wm & B(nxt)) == 0 && (((PEND & SKIPPED_RANGE) == 0 && !ADMITTED_ALIVE) || slow > 0))
#ifndef NO_ORDER_SWEEP
#define SWEEP_DUE (wm != 0 && (SWEEP_RESEND || SWEEP_SKIP))
#else
#define SWEEP_DUE 0
#endif

/* one delivery of run r (number r + 1) on worker w; resent: a message the order book kept */
inline ORD_DELIVER(rr, resent, x) {
  NEWID(x); alive = alive | B(x); pendc[rr + 1]++; run Ord(rr, resent, x); x = 0
}
proctype Ord(byte r; bit resent; byte w) {
  byte succ, x;
  mtype rep;
  bit pending = 1;   /* on its way to the gate */
  {
    atomic {
      if
      :: !resent && missing > 0 ->   /* its message never arrives (publish failed, purged, revoked) */
         d_step { missing--; pendc[r + 1]--; pending = 0; out[r] = O_TURNED; printf("run %d: its message never arrives\n", r) };
         goto fin
      :: else -> skip
      fi;
      d_step {
        ORDER_GATE(r + 1, w, rep); pendc[r + 1]--; pending = 0;
        /* admitted (its number is no longer kept waiting): from now on it is a run that started */
        if :: rep == GO || rep == LATE_TURN -> out[r] = O_RUNNING :: else -> skip fi
      };
      printf("worker %d: run %d ORDER_GATE #%d -> %e\n", w, r, r + 1, rep);
      if
      :: rep == WAIT -> d_step { WAITS(r) }; goto fin   /* PENDING, journaled: its message is in the book */
      :: rep == ANOTHER_DELIVERY -> goto fin
      :: else -> skip
      fi
    }
    d_step {
      /* it takes the lease or enters the queue (the lease's FIFO keeps this order) */
      placed = placed | B(r + 1);
      /* P9: every smaller number went before it or was skipped, unless its own was skipped */
      assert((skm & B(r + 1)) != 0 || ((placed | skm) & (B(r + 1) - 2)) == (B(r + 1) - 2));
      printf("worker %d: run %d takes its place\n", w, r)
    }
    atomic {
      if
      :: rep == GO ->
         d_step { ORDER_ADVANCE(r + 1, w, succ) }; printf("worker %d: run %d ORDER_ADVANCE -> sends #%d\n", w, r, succ);
         if :: succ != 0 -> ORD_DELIVER(succ - 1, 1, x); succ = 0 :: else -> skip fi
      :: else -> skip   /* LATE: it goes on by arrival */
      fi
    }
    d_step { ran[r]++; assert(ran[r] <= 1) /* P5 */; out[r] = O_DONE; printf("worker %d: run %d's body\n", w, r) }
fin:
    /* an ended process keeps its place until those after it end: its locals are cleared */
    atomic { alive = alive & ~B(w); r = 0; resent = 0; w = 0; succ = 0; rep = 0 }
  } unless {
    (gone & B(w)) != 0 ->
    d_step {
      alive = alive & ~B(w); if :: pending -> pendc[r + 1]-- :: else -> skip fi;
      if :: out[r] == O_SENT || out[r] == O_RUNNING -> out[r] = O_LOST :: else -> skip fi;
      r = 0; resent = 0; w = 0; succ = 0; rep = 0; pending = 0
    }
  }
}

proctype Sweeper() {
  byte succ, x;
end:
  do
  :: atomic {
       SWEEP_DUE ->
       d_step {
         if
         :: (wm & B(nxt)) != 0 ->   /* handed on, not started: sent again */
            if :: (PEND & B(nxt)) != 0 -> slow-- :: else -> skip fi;
            succ = nxt
         :: else ->                 /* the numbers before the first waiting one never came: skipped */
            if :: (PEND & SKIPPED_RANGE) != 0 || ADMITTED_ALIVE -> slow-- :: else -> skip fi;
            skm = skm | SKIPPED_RANGE; succ = 1;
            do :: (wm & B(succ)) == 0 -> succ++ :: else -> break od;
            nxt = succ; adm = 0; admd = 0
         fi
       }
       printf("sweeper: ORDER_SWEEP sends #%d (skipped %d)\n", succ, skm);
       ORD_DELIVER(succ - 1, 1, x); succ = 0
     }
  od
}

init {
  byte r, x;
  atomic {
    run Reaper(); run Sweeper();
    do :: r < RUNS -> ORD_DELIVER(r, 0, x); r++ :: else -> break od
  }
  timeout ->
  /* P4: at quiescence every run ended terminal */
  d_step { for (i : 0 .. RUNS - 1) { assert(TERMINAL(out[i])) } }
}
#endif
