"""The Redis protocol, declared: every Redis call of the library goes through this package.

Each feature owns its Lua (``lua/<feature>/*.lua``, assembled by :mod:`.lua`), the calls that
send it and the decoding of its replies, with each reply code a named constant that the Lua
sees under the same name:

==================  ===========================================================================
:mod:`.lease`       the core lease: ACQUIRE, RENEW, RELEASE, PROGRESS, REVISE_OUTCOME
:mod:`.handoff`     duplicates that wait (PARK, JOIN), the sweeper's RESUME, FORCE_RELEASE
:mod:`.newest`      ``coalesce`` and ``supersede`` (COALESCE), the superseding index
:mod:`.order`       ``ordered=True``: ORDER_TAKE, ORDER_GATE, ORDER_ADVANCE, ORDER_SWEEP
:mod:`.marks`       the enqueue marker, the idempotency window, duplicates noted on the holder
:mod:`.timing`      ``debounce`` and ``key_rate_limit``, and their state for readers
:mod:`.fences`      fenced values in the user's Redis (``fencing.fenced_set``)
:mod:`.reads`       status reads: records with the server's clock, listing, histories
:mod:`.server`      what the worker's start checks ask of a Redis
==================  ===========================================================================

The shared state is declared once: the run record's fields in :mod:`.record` (their machinery,
the protocol version and the record's text layout in :mod:`.fields`), every Redis key as a
:class:`~.layout.Part` of its feature, the timing numbers in :mod:`..constants`.
:class:`~.store.LeaseStore` puts it together for one namespace.
"""
