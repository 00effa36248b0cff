"""The worker side: the bootstep wired when a guarded task is bound (:mod:`.bootstep`), the start
checks (:mod:`.pools`, :mod:`.preflight`, :mod:`.findings`), the sweeper's thread and its jobs
(:mod:`.sweeper`), and finding an app's guarded tasks (:mod:`.registry`)."""
