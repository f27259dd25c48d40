"""``local_cluster()``: a single-machine Dask cluster with one process per device."""

from __future__ import annotations

import logging
from typing import Any

from distributed import LocalCluster

__all__ = ["local_cluster", "gpu_count"]

logger = logging.getLogger(__name__)


def gpu_count() -> int:
    """Number of NVIDIA GPUs NVML reports here (0 without NVML, a driver or a GPU)."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "no usable GPU"
        return 0


def local_cluster(n_workers: int | None = None, **kwargs: Any):
    """Start a local Dask cluster suited to worker groups.

    With GPUs and dask-cuda (the ``cuda`` extra) present: a
    ``dask_cuda.LocalCUDACluster`` (one worker per GPU, each with a rotated
    ``CUDA_VISIBLE_DEVICES``). Otherwise a process-based ``distributed.LocalCluster``
    with one thread per worker.

    Args:
        n_workers: number of worker processes (default: one per GPU, or one per core
            without GPUs).
        **kwargs: passed to the cluster class (e.g. ``dashboard_address``,
            ``CUDA_VISIBLE_DEVICES`` for LocalCUDACluster, ``host``).
    Returns:
        the cluster; use it as a context manager and connect ``Client(cluster)``.
    Raises:
        whatever the cluster class raises for bad arguments.
    """
    if gpu_count() > 0:
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            logger.info(
                "GPUs found but dask-cuda is not installed (the cuda extra of daskwg's wheel); using LocalCluster"
            )
        else:
            if n_workers is not None:
                kwargs.setdefault("n_workers", n_workers)
            return LocalCUDACluster(**kwargs)
    kwargs.setdefault("processes", True)
    kwargs.setdefault("threads_per_worker", 1)
    if n_workers is not None:
        kwargs["n_workers"] = n_workers
    return LocalCluster(**kwargs)
