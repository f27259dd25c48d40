"""What a worker's call counters look like when they cross to the scheduler.

The worker side counts (``daskwg.plugin.metrics``) and the scheduler side adds the
workers' counts together (``daskwg.scheduler.metrics``); both read the histogram's bucket
bounds and the snapshot's shape (:class:`MetricsSnapshot`, the ``daskwg_metrics`` comm
handler's reply) from here.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["BUCKETS", "MetricsSnapshot"]

#: Upper bounds (seconds) of the call duration histogram's buckets: a 1 ms echo up to a
#: training step of minutes; the implicit last bucket is ``+Inf``.
BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 1800.0)


class MetricsSnapshot(TypedDict):
    """One worker's counters as plain data (lists, so Dask's comm sends them as msgpack).

    Attributes:
        calls: ``[group, method, outcome ("ok" or "error"), count]`` per key.
        durations: ``[group, method, per-bucket counts (not cumulative, one per bound of
            BUCKETS and a last one for +Inf), sum of seconds]`` per group and method.
        bytes: ``[group, direction ("in": arguments, "out": results), bytes]``.
    """

    calls: list[list]
    durations: list[list]
    bytes: list[list]
