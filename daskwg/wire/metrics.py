"""What a worker's call counters look like when they cross to the scheduler.

The worker side counts (``daskwg.plugin.metrics``) and the scheduler side adds the
workers' counts together (``daskwg.scheduler.metrics``); both read the histogram's bucket
bounds from here.
"""

from __future__ import annotations

__all__ = ["BUCKETS"]

#: Upper bounds (seconds) of the call duration histogram's buckets: a 1 ms echo up to a
#: training step of minutes; the implicit last bucket is ``+Inf``.
BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 1800.0)
