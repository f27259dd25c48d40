"""The workers' call counters added together, in the scheduler, for Prometheus.

The scheduler's dashboard plugin (``daskwg.scheduler.dashboard``) asks every worker for
its counters (the ``daskwg_metrics`` comm handler, answered with
``daskwg.plugin.metrics.CallMetrics.snapshot``) and adds them with :func:`merge` before
exporting them as ``daskwg_*`` series on the scheduler's ``/metrics``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ..wire.metrics import MetricsSnapshot

__all__ = ["merge"]


def merge(snapshots: Iterable[MetricsSnapshot]) -> dict:
    """Add up the counters of several workers (each a
    :class:`~daskwg.wire.metrics.MetricsSnapshot`; a missing key counts as empty).

    Returns:
        ``{"calls": {(group, method, outcome): n}, "durations": {(group, method):
        (bucket counts, sum seconds)}, "bytes": {(group, direction): n}}``.
    """
    calls: dict = defaultdict(int)
    durations: dict = {}
    nbytes: dict = defaultdict(int)
    for snap in snapshots:
        for g, m, o, n in snap.get("calls", ()):
            calls[(g, m, o)] += n
        for g, m, counts, total in snap.get("durations", ()):
            old, old_total = durations.get((g, m), ([0] * len(counts), 0.0))
            durations[(g, m)] = ([a + b for a, b in zip(old, counts)], old_total + total)
        for g, d, n in snap.get("bytes", ()):
            nbytes[(g, d)] += n
    return {"calls": dict(calls), "durations": durations, "bytes": dict(nbytes)}
