"""The thin stand-ins that point verl's tests at daskwg: ``ray`` and ``verl.single_controller.ray``.

Everything else verl's tests import is the real verl package (``Worker``, ``register``,
``Dispatch``, ``DataProto``, ``verl.utils``). :func:`install` puts two module objects
into ``sys.modules`` before verl is imported, in the pytest process (the driver, from
``plugin.py``) and in every Dask worker process (as a Dask preload of this file), since
ranks unpickle the tests' classes by importing the test modules there.

``ray`` maps to daskwg as a verl user's code would map it:

- ``ray.init()`` gives a client of one local cluster (4 worker processes, started on
  the first call and kept for the session); ``ray.shutdown()`` closes that client, which
  releases its groups' ranks.
- ``ray.remote`` on a class returns the class (``RayClassWithInitArgs`` instantiates it
  on the ranks); on a function, an object whose ``.remote(*args)`` runs it as a Dask
  task on a worker, in another process, as a Ray task runs.
- ``ray.get`` is ``daskwg.get``; ``ray.put`` scatters to the cluster; ``ray.ObjectRef``
  is ``distributed.Future``.
- ``ray.util.get_node_ip_address()`` is the host of the Dask worker it runs on.

``verl.single_controller.ray`` (and ``.base``) is ``daskwg.verl``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import types
from typing import Any

#: Dask workers of the session's cluster (verl's CPU tests use at most 4 ranks).
N_WORKERS = 4

_state: dict[str, Any] = {"cluster": None, "client": None}
_lock = threading.Lock()


def _cluster() -> Any:
    import daskwg

    if _state["cluster"] is None:
        _state["cluster"] = daskwg.local_cluster(
            n_workers=N_WORKERS,
            dashboard_address=":0",
            worker_dashboard_address=":0",
            preload=[os.path.abspath(__file__)],
        )
        atexit.register(_close_cluster)
    return _state["cluster"]


def _close_cluster() -> None:
    shutdown()
    cluster, _state["cluster"] = _state["cluster"], None
    if cluster is not None:
        cluster.close()


def init(*args: Any, **kwargs: Any) -> Any:
    """``ray.init``: a fresh client of the session's cluster, set as the default client.

    A client still open from a test that did not reach its ``ray.shutdown()`` is closed
    first, so every test starts without the previous one's groups.
    """
    from distributed import Client

    with _lock:
        shutdown()
        cluster = _cluster()
        client = Client(cluster, set_as_default=True)
        client.wait_for_workers(N_WORKERS, timeout=60)
        _state["client"] = client
        return client


def shutdown(*args: Any, **kwargs: Any) -> None:
    """``ray.shutdown``: close the client; the workers release its groups' ranks."""
    client, _state["client"] = _state["client"], None
    if client is not None:
        client.close()


def is_initialized() -> bool:
    return _state["client"] is not None


class _RemoteFunction:
    """``ray.remote(fn)``: ``.remote(*args, **kwargs)`` runs ``fn`` as a Dask task."""

    def __init__(self, fn: Any):
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from distributed import get_client

        return get_client().submit(self._fn, *args, pure=False, **kwargs)

    def options(self, **options: Any) -> _RemoteFunction:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a remote function is called with .remote(...)")


def remote(*args: Any, **options: Any) -> Any:
    """``ray.remote``: classes unchanged, functions as Dask tasks; ``@ray.remote(num_cpus=...)`` too."""

    def wrap(target: Any) -> Any:
        return target if isinstance(target, type) else _RemoteFunction(target)

    if len(args) == 1 and not options and callable(args[0]):
        return wrap(args[0])
    return wrap


def get(refs: Any, *args: Any, **kwargs: Any) -> Any:
    import daskwg

    return daskwg.get(refs)


def put(value: Any, *args: Any, **kwargs: Any) -> Any:
    from distributed import get_client

    # Wrapped in a list: scatter would otherwise store each entry of a dict or list apart.
    return get_client().scatter([value], hash=False)[0]


def get_node_ip_address(*args: Any, **kwargs: Any) -> str:
    from distributed import get_worker
    from distributed.comm.addressing import get_address_host

    try:
        return get_address_host(get_worker().address)
    except ValueError:  # not on a Dask worker: the driver
        return "127.0.0.1"


def get_runtime_context() -> Any:
    raise NotImplementedError("ray.get_runtime_context() has no daskwg counterpart in this stand-in")


def _ray_module() -> types.ModuleType:
    from distributed import Future

    ray = types.ModuleType("ray", "stand-in for ray, pointed at daskwg (tests/verl_suite/standins.py)")
    util = types.ModuleType("ray.util")
    util.get_node_ip_address = get_node_ip_address
    actor = types.ModuleType("ray.actor")
    actor.ActorHandle = object
    for name, value in {
        "init": init,
        "shutdown": shutdown,
        "is_initialized": is_initialized,
        "remote": remote,
        "get": get,
        "put": put,
        "get_runtime_context": get_runtime_context,
        "ObjectRef": Future,
        "util": util,
        "actor": actor,
        "__version__": "0.0-daskwg-standin",
    }.items():
        setattr(ray, name, value)
    ray.__path__ = []  # a package, so that ``import ray.util`` finds sys.modules["ray.util"]
    return ray


def install() -> None:
    """Put the stand-ins into ``sys.modules`` (idempotent). Call before verl is imported."""
    if getattr(sys.modules.get("ray"), "__version__", "") == "0.0-daskwg-standin":
        return
    ray = _ray_module()
    sys.modules["ray"] = ray
    sys.modules["ray.util"] = ray.util
    sys.modules["ray.actor"] = ray.actor

    import daskwg.verl

    for name in ("verl.single_controller.ray", "verl.single_controller.ray.base"):
        module = types.ModuleType(name, "stand-in: daskwg.verl")
        module.__dict__.update({k: getattr(daskwg.verl, k) for k in daskwg.verl.__all__})
        module.__all__ = list(daskwg.verl.__all__)
        sys.modules[name] = module
    sys.modules["verl.single_controller.ray"].base = sys.modules["verl.single_controller.ray.base"]
    sys.modules["verl.single_controller.ray"].__path__ = []


def dask_setup(worker: Any) -> None:
    """Dask preload hook: every worker process gets the stand-ins before any task runs."""
    install()
