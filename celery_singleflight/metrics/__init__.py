"""Prometheus metrics: the series (:mod:`.catalog`), counting them in each process
(:mod:`.record`, :mod:`.hooks`), the gauges read from Redis (:mod:`.gauges`) and serving them
(:mod:`.exporter`). ``prometheus_client`` is imported only when metrics are on."""
