"""Prometheus metrics: what the workers count, what Redis holds, and how both are served.

* :mod:`.definitions`: every metric's name, type, help, labels and buckets (plain data);
* :mod:`.record`: the one-line hooks the races, timers, pool and providers call (no-ops when
  ``prometheus_client`` is not installed or ``GPUHEDGE_METRICS=0``);
* :mod:`.redis_gauges`: a collector that reads the gauges Redis holds at scrape time (GPUs
  free/busy per pool, waiters, races in flight, timer backlog);
* :mod:`.exposition`: the HTTP endpoints: a worker's own (multiprocess mode, for prefork) and
  ``gpuhedge-celery metrics serve``'s.

``docs/metrics.md`` explains each metric and each alert.
"""
