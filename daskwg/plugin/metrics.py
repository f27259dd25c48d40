"""What every Dask worker counts about the calls it hosts, for Prometheus.

The host plugin (``daskwg.plugin.host``) keeps one :class:`CallMetrics` per worker
process and answers the ``daskwg_metrics`` comm handler with
:meth:`CallMetrics.snapshot`; the scheduler's dashboard plugin adds the snapshots of all
workers together (``daskwg.scheduler.metrics``). Counters live as long as the worker
process: a restarted worker starts from zero, as Prometheus counters do after a process
restart.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..protocol import DataProto
from ..wire.metrics import BUCKETS, MetricsSnapshot

__all__ = ["CallMetrics", "payload_nbytes"]

# Nested containers deeper than this are not walked (bytes there are not counted).
_MAX_DEPTH = 6


# Types that hold no tensor or array bytes, told apart by exact type in payload_nbytes.
_NO_BYTES = frozenset({type(None), bool, int, float, complex, str, bytes})
_PlainTensorDict = TensorDict


def payload_nbytes(obj: Any, _depth: int = 0) -> int:
    """Bytes of tensor and array data in ``obj``: what a call's arguments or result weigh.

    Counts ``torch.Tensor`` (its own elements: a view counts only its bytes, as it
    travels), ``numpy.ndarray`` (``nbytes``), and walks ``DataProto``/``TensorDict``
    (duck-typed), lists, tuples and dicts. Scalars and other objects count 0: they are
    small next to the batches, and measuring them would cost a pickle.

    It runs twice per hosted call (arguments and result), so the common kinds are told
    by their exact type first (a scalar costs one set lookup, ~0.1 µs) and only other
    objects by ``isinstance`` and attribute checks.
    """
    kind = type(obj)
    if kind in _NO_BYTES or _depth > _MAX_DEPTH:
        return 0
    if kind is tuple or kind is list:
        return _sum_of(obj, _depth)
    if kind is dict:
        return _sum_of(obj.values(), _depth)
    if kind is torch.Tensor or isinstance(obj, torch.Tensor):
        if obj.layout is not torch.strided:
            return 0
        return obj.nbytes  # its own elements (a view's, not its base's)
    if kind is np.ndarray or isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if kind is DataProto:
        return payload_nbytes(obj.batch, _depth + 1) + payload_nbytes(obj.non_tensor_batch, _depth + 1)
    if kind is _PlainTensorDict:
        # Its own entries: tensors, and nested TensorDicts, which this walk opens in turn.
        return _sum_of(obj._tensordict.values(), _depth)
    if hasattr(obj, "header") and hasattr(obj, "buffers"):
        # A result snapshotted at return (serialization.Packed): its out-of-band buffers
        # are the tensors' and arrays' bytes.
        return sum(memoryview(b).nbytes for b in obj.buffers)
    if isinstance(obj, (list, tuple)):
        return _sum_of(obj, _depth)
    if isinstance(obj, Mapping):
        return _sum_of(obj.values(), _depth)
    if hasattr(obj, "non_tensor_batch") and hasattr(obj, "batch"):  # DataProto
        return payload_nbytes(obj.batch, _depth + 1) + payload_nbytes(obj.non_tensor_batch, _depth + 1)
    if hasattr(obj, "batch_size") and hasattr(obj, "values") and hasattr(obj, "keys"):  # TensorDict
        try:
            leaves = obj.values(include_nested=True, leaves_only=True)
        except TypeError:
            leaves = obj.values()
        return _sum_of(leaves, _depth)
    return 0


def _sum_of(items: Iterable, depth: int) -> int:
    total = 0
    for v in items:
        if type(v) not in _NO_BYTES:
            total += payload_nbytes(v, depth + 1)
    return total


class CallMetrics:
    """Per-process counters of hosted calls (thread-safe; the host thread records,
    the worker's event loop reads).

    Keys are ``(group name, method)``; the outcome is ``"ok"`` or ``"error"``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self._sums: dict[tuple[str, str], float] = defaultdict(float)
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)

    def record_call(self, group: str, method: str, ok: bool, seconds: float) -> None:
        """Count one finished call of ``group.method`` that took ``seconds``."""
        with self._lock:
            self._calls[(group, method, "ok" if ok else "error")] += 1
            counts = self._buckets.setdefault((group, method), [0] * (len(BUCKETS) + 1))
            counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            self._sums[(group, method)] += seconds

    def record_bytes(self, group: str, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` that arrived at a rank (``"in"``: arguments, futures' parts
        included) or that a rank returned (``"out"``)."""
        if nbytes:
            with self._lock:
                self._bytes[(group, direction)] += nbytes

    def snapshot(self) -> MetricsSnapshot:
        """The counters as plain data for the comm layer (their shape:
        :class:`~daskwg.wire.metrics.MetricsSnapshot`)."""
        with self._lock:
            return {
                "calls": [[g, m, o, n] for (g, m, o), n in self._calls.items()],
                "durations": [[g, m, list(c), self._sums[(g, m)]] for (g, m), c in self._buckets.items()],
                "bytes": [[g, d, n] for (g, d), n in self._bytes.items()],
            }
