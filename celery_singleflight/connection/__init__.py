"""The Redis connection layer: where the leases live (:mod:`.targets`), one client per target and
process and what an error means (:mod:`.clients`), a script called the shortest way
(:mod:`.scripts`), and what a Cluster changes (:mod:`.cluster`). What is sent is the protocol's
business (:mod:`..protocol`)."""
