"""Groups: the driver's group API, what a verl user calls.

* ``group``: :class:`WorkerGroup` (build, bind, shutdown, attach).
* ``binding``: registered methods bound on a group, and ``execute_*``.
* ``roles``: the per-role groups of a colocated class (``spawn``/``fuse``).
* ``colocate``: ``create_colocated_worker_cls``, several roles in one rank.
* ``pool``: :class:`ResourcePool`, an ordered set of workers groups share.
* ``restart``: ``wg.restart()``, fresh processes for a group.
* ``heal``: ``wg.heal()`` and ``wg.resize(n)``, lost ranks replaced and groups grown or
  shrunk with the surviving ranks kept.
* ``resolve``: ``daskwg.get``, waiting for what non-blocking calls returned.
* ``install``: the plugins a group needs on the cluster, and the version check.
"""
