"""The run lifecycle: one run of a key from take to settle (:mod:`.guard`), the lease it holds
(:mod:`.lease`), the heartbeat that renews it, its progress, the one place a release's duties are
carried out (:mod:`.settle`), a task's run as a pipeline of stages (:mod:`.stage`,
:mod:`.pipeline`), Redis outages (:mod:`.outage`) and the task events a run sends (:mod:`.events`).
Its two doors sit above it: ``SingleFlightTask`` (``task.py``) and ``hold()`` (``hold.py``)."""
