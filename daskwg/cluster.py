"""``local_cluster()``: a single-machine Dask cluster with one process per device."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import dask.config
from dask.utils import parse_timedelta
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


#: Worker settings ``local_cluster()`` picks for long-lived rank state, and why.
RANK_WORKER_CONFIG: dict[str, Any] = {
    # Rank code starts child processes (DataLoader workers, inference engines); Dask
    # starts nanny workers as daemons, which multiprocessing forbids to have children.
    "distributed.worker.daemon": False,
    # A rank's model and optimizer state is memory Dask does not manage: pausing cannot
    # free it and would only stop the rank's own calls from starting.
    "distributed.worker.memory.pause": False,
    # Spilling moves only Dask-managed data (results of non-blocking calls) to disk; with
    # rank state filling the process it would spill every result as soon as it is made.
    "distributed.worker.memory.target": False,
    "distributed.worker.memory.spill": False,
    # Dask's statistical profiler wakes every worker's event loop every 10 ms
    # (distributed.worker.profile.interval) to sample the threads of its tasks, and (but
    # on Python 3.11) samples the loop of every server from a thread of its own, the
    # driver's scheduler and nannies included. Ranks run on the host thread, which it
    # never samples; on a busy host the wake-ups take ~1.4% of a core per worker, and
    # the GIL from the threads that serve calls (measured on 2 cores: 3.7% -> 2.3% of a
    # core per idle worker; small non-blocking calls ~5% faster).
    "distributed.worker.profile.enabled": False,
    # Every Dask server measures its event loop's responsiveness with a callback every
    # 20 ms (distributed.admin.tick.interval): a task scheduled 50 times a second on
    # each worker, and on the scheduler and every nanny of local_cluster()'s driver
    # process. Once a second still catches an event loop blocked for its 3 s limit
    # (distributed.admin.tick.limit), which is all it warns about; an idle worker's CPU
    # went 9-10 -> 3 ms a second (measured on 2 cores), 32 of them 0.3 -> 0.1 of a core.
    "distributed.admin.tick.interval": "1s",
}

#: Of :data:`RANK_WORKER_CONFIG`, what also applies to the servers ``local_cluster()``
#: starts in the calling process (the scheduler and the nannies, on one event loop).
DRIVER_SIDE_KEYS = ("distributed.worker.profile.enabled", "distributed.admin.tick.interval")

#: The preload module ``local_cluster()`` adds to its workers: they ignore SIGINT, so a
#: Ctrl-C in the driver's terminal (whose process group they share) leaves them running.
SIGINT_PRELOAD = "_daskwg_task"


def _worker_config(user_config: dict | None) -> dict:
    """The workers' Dask config: this process's, with :data:`RANK_WORKER_CONFIG` for
    every key the user left at Dask's default, then what the caller passed as ``config=``."""
    # Nanny merges config= into its own copy of dask.config key by key, not deeply: hand
    # it the whole configuration, merged here.
    return dask.config.merge(dask.config.config, _chosen(RANK_WORKER_CONFIG), user_config or {})


def _chosen(settings: dict[str, Any]) -> dict:
    """``settings`` (dotted keys) nested, for the keys this process's config leaves at Dask's default."""
    shipped = dask.config.merge(*dask.config.defaults)
    chosen: dict = {}
    for key, value in settings.items():
        if dask.config.get(key, default=None) == dask.config.get(key, default=None, config=shipped):
            chosen = dask.config.merge(chosen, _nest(key, value))
    return chosen


def _start(cls: type, kwargs: dict, user: dict) -> Any:
    """``cls(**kwargs)`` with :data:`DRIVER_SIDE_KEYS` in force for the servers it starts
    here, unless set otherwise in this process's config or in ``user`` (the caller's
    ``config=``)."""
    shipped = dask.config.merge(*dask.config.defaults)
    driver_side = {
        key: RANK_WORKER_CONFIG[key]
        for key in DRIVER_SIDE_KEYS
        if dask.config.get(key, default=None, config=user) is None
        and dask.config.get(key, default=None) == dask.config.get(key, default=None, config=shipped)
    }
    restore = _silence_propagated_logs(kwargs.get("silence_logs", logging.WARN))
    try:
        with dask.config.set(driver_side):
            cluster = cls(**kwargs)
    except BaseException:
        restore()
        raise
    close = cluster._close

    async def close_then_restore() -> Any:
        try:
            return await close()
        finally:
            restore()

    cluster._close = close_then_restore
    return cluster


def _silence_propagated_logs(silence_logs: Any) -> Callable[[], None]:
    """Make ``LocalCluster``'s ``silence_logs`` (default ``logging.WARN``) hold also when
    Dask's records reach the root logger's handlers; returns what undoes it.

    Dask silences an in-process cluster by raising the level of the ``StreamHandler`` it
    gives the ``distributed`` logger (``distributed.utils.silence_logging_cmgr``). Dask
    gives it none when the root logger has handlers as ``distributed`` is first imported
    (``distributed.config``): then its INFO records (every server's start and stop, some
    80 lines for two workers) go to the root's handlers, unsilenced. ``import verl`` does
    that (``logging.basicConfig`` in ``verl/__init__.py``). The ``distributed`` logger's
    own level is raised instead, while the cluster runs (its ``close()`` puts it back); a
    level the program set higher, and ``silence_logs=False``, are left alone."""
    logger = logging.getLogger("distributed")
    if isinstance(silence_logs, str):
        silence_logs = logging.getLevelName(silence_logs.upper())
    if (
        isinstance(silence_logs, bool)
        or not isinstance(silence_logs, int)
        or any(isinstance(h, logging.StreamHandler) for h in logger.handlers)
        or logger.getEffectiveLevel() >= silence_logs
    ):
        return lambda: None
    before = logger.level
    logger.setLevel(silence_logs)

    def restore() -> None:
        if logger.level == silence_logs:  # unless the program set another meanwhile
            logger.setLevel(before)

    return restore


def _with_sigint_preload(kwargs: dict) -> None:
    """Add :data:`SIGINT_PRELOAD` to the workers' preloads (the caller's ``preload=``, or
    ``distributed.worker.preload``, which an explicit ``preload=`` would replace)."""
    preload = kwargs.get("preload")
    if preload is None:
        preload = dask.config.get("distributed.worker.preload", default=[])
    preload = [preload] if isinstance(preload, str) else list(preload)
    if SIGINT_PRELOAD not in preload:
        preload.append(SIGINT_PRELOAD)
    kwargs["preload"] = preload


def _check_in_process(kwargs: dict) -> None:
    """Raise ``ValueError`` for arguments of ``kwargs`` that ``LocalCluster`` would hand
    to its workers but only a ``Nanny`` accepts: with ``processes=False`` Dask starts
    ``Worker`` objects in this process and fails deep inside with a ``TypeError``."""
    import inspect

    from distributed import Nanny, Worker
    from distributed.core import Server

    def names(fn: Any) -> set[str]:
        return set(inspect.signature(fn).parameters)

    nanny_only = names(Nanny.__init__) - names(Worker.__init__) - names(Server.__init__)
    bad = sorted(set(kwargs) & (nanny_only - names(LocalCluster.__init__)))
    if bad:
        raise ValueError(
            f"local_cluster(processes=False) got {', '.join(f'{k}=' for k in bad)}, which only a worker "
            "process (Nanny) takes: in-process workers share this process's settings. Set them here "
            "instead (dask.config.set(...) for config=, os.environ for env=) or drop processes=False"
        )


def _nest(key: str, value: Any) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


#: Seconds a local cluster keeps the Nanny of a worker that left before closing it for good
#: (instead of Dask's ``distributed.deploy.lost-worker-timeout``, 15 s, where that is lower).
#: A Nanny restarts a process that died at once, and the timer starts then: on a loaded
#: machine the new process (importing torch) can take longer than 15 s, and the cluster
#: would stay a worker short, the group's ``wg.restart()`` waiting for it in vain.
KEEP_NANNIES_S = 120.0
_LOST_WORKER_TIMEOUT = "distributed.deploy.lost-worker-timeout"


def _keep_nannies(cluster: Any) -> Any:
    """``cluster`` (a ``SpecCluster``) keeping lost workers' Nannies :data:`KEEP_NANNIES_S`
    seconds: the timeout is read when the scheduler reports the removal, in
    ``_update_worker_status``, which this wraps on the instance."""
    update = cluster._update_worker_status

    def update_worker_status(op: str, msg: Any) -> Any:
        current = parse_timedelta(dask.config.get(_LOST_WORKER_TIMEOUT, default="15s"), default="seconds")
        if op != "remove" or (current is not None and current >= KEEP_NANNIES_S):
            return update(op, msg)
        with dask.config.set({_LOST_WORKER_TIMEOUT: f"{KEEP_NANNIES_S:g}s"}):
            return update(op, msg)

    cluster._update_worker_status = update_worker_status
    return cluster


def local_cluster(n_workers: int | None = None, **kwargs: Any) -> LocalCluster:
    """Start a local Dask cluster suited to worker groups.

    With GPUs and dask-cuda (the ``cuda`` extra) present: a
    ``dask_cuda.LocalCUDACluster`` (one worker per GPU, each with a rotated
    ``CUDA_VISIBLE_DEVICES``). Otherwise a process-based ``distributed.LocalCluster``
    with one thread per worker.

    The worker processes ignore SIGINT: they share the driver's process group, so a
    Ctrl-C in its terminal would kill them too; the driver alone gets the
    ``KeyboardInterrupt`` and the ranks keep their state (as Ray's workers do).

    The cluster keeps the Nanny of a worker whose process died for ``KEEP_NANNIES_S`` (120)
    seconds (Dask: ``distributed.deploy.lost-worker-timeout``, 15 s), however long the
    restarted process takes to start, so ``wg.restart()`` after a crash finds it.

    Args:
        n_workers: number of worker processes (default: one per GPU, or one per core
            without GPUs).
        **kwargs: passed to the cluster class (e.g. ``dashboard_address``,
            ``CUDA_VISIBLE_DEVICES`` for LocalCUDACluster, ``host``).

    Returns:
        the cluster; use it as a context manager and connect ``Client(cluster)``.

    Raises:
        ValueError: ``processes=False`` with an argument only a Nanny (a worker process)
            takes, e.g. ``config=`` or ``env=``: in-process workers share this process's
            settings (use ``dask.config.set`` and ``os.environ`` here instead), raised
            before anything starts.
        Exception: whatever the cluster class raises for other bad arguments.
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
            user = kwargs.get("config") or {}
            kwargs["config"] = _worker_config(user)
            _with_sigint_preload(kwargs)
            return _keep_nannies(_start(LocalCUDACluster, kwargs, user))
    kwargs.setdefault("processes", True)
    if not kwargs["processes"]:
        _check_in_process(kwargs)
    user = kwargs.get("config") or {}
    if kwargs["processes"]:
        kwargs["config"] = _worker_config(user)
        _with_sigint_preload(kwargs)
    kwargs.setdefault("threads_per_worker", 1)
    if n_workers is not None:
        kwargs["n_workers"] = n_workers
    return _keep_nannies(_start(LocalCluster, kwargs, user))
