"""Role groups of a colocated group: :class:`RoleGroup`, what ``WorkerGroup.spawn`` and
``WorkerGroup.fuse`` give (verl's ``RayWorkerGroup.spawn`` / ``fuse``).

A role group binds one role's registered methods over the colocated group's ranks and
sends each call as ``"<role>_<method>"``, the name under which the colocated instance
answers for that role's method (see ``daskwg.groups.colocate``). It owns nothing: ranks,
connection and failure state are the colocated group's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .binding import BoundGroup
from .colocate import ColocatedWorker

__all__ = ["RoleGroup", "spawn_role_groups"]


class RoleGroup(BoundGroup):
    """One role of a colocated group: the role's registered methods over the same ranks.

    Args:
        parent: the colocated :class:`~daskwg.groups.group.WorkerGroup`.
        role: the role's name.
        role_cls: the role's class (its registered methods are bound here).

    Only its bound methods and its mesh caches (``_dispatch_info``/``_collect_info``,
    filled from the role's own mesh registration) are its own; the rest is the parent's,
    read live, so the role group never holds a stale copy.
    """

    def __init__(self, parent: Any, role: str, role_cls: type):
        self._parent = parent
        self._role = role
        self._cls = role_cls
        self._name = f"{parent.name}.{role}"
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._methods = self._bind_registered_methods()

    @property
    def world_size(self) -> int:
        """Number of ranks (the colocated group's)."""
        return self._parent.world_size

    @property
    def workers(self) -> list[str]:
        """Dask worker address of every rank (the colocated group's)."""
        return self._parent.workers

    @property
    def name(self) -> str:
        """``"<group>.<role>"``."""
        return self._name

    def shutdown(self) -> None:
        """Does nothing: the ranks belong to the colocated group; shut that one down."""

    def __repr__(self) -> str:
        return f"<role group {self._role!r} of {self._parent!r}>"

    def _describe_class(self) -> str:
        return f"role {self._role!r} ({self._cls.__name__})"

    def _check_usable(self, method_name: str) -> None:
        self._parent._check_usable(f"{self._role}_{method_name}")

    def _dispatch_fns(self, registered: Any) -> dict[str, Any]:
        return self._parent._dispatch_fns(registered)

    def _deliver(self, method_name: str, ranks: list[int], payloads: list, **options: Any) -> list:
        return self._parent._deliver(f"{self._role}_{method_name}", ranks, payloads, **options)

    def _gather_any(self, futures: list) -> list:
        return self._parent._gather_any(futures)


def spawn_role_groups(group: Any, prefix_set: Iterable[str]) -> dict[str, RoleGroup]:
    """``WorkerGroup.spawn``: one :class:`RoleGroup` per requested role, in the order given.

    Raises:
        TypeError: ``group`` does not run a ``ColocatedWorker``, or ``prefix_set`` is a string.
        ValueError: an unknown role name.
    """
    if not (isinstance(group._cls, type) and issubclass(group._cls, ColocatedWorker)):
        raise TypeError(
            f"spawn needs a group built from create_colocated_worker_cls (a ColocatedWorker); "
            f"group {group.name!r} runs {group._cls.__name__}"
        )
    if isinstance(prefix_set, str):
        raise TypeError("prefix_set must be a collection of role names, not a string")
    wanted = list(prefix_set)
    role_classes = group._role_classes
    if role_classes is None:
        # Not built by this driver (attached): ask rank 0.
        role_classes = group._send("role_classes", [0], [((), {})], blocking=True)[0]
    unknown = [role for role in wanted if role not in role_classes]
    if unknown:
        raise ValueError(f"group {group.name!r} has no role(s) {unknown}; its roles are {list(role_classes)}")
    return {role: RoleGroup(group, role, role_classes[role]) for role in wanted}
