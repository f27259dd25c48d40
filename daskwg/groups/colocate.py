"""Colocation: several roles (actor, critic, ...) in one Worker per rank.

:func:`create_colocated_worker_cls` gives the :class:`ClassWithInitArgs` of a
:class:`ColocatedWorker`, which builds one instance of every role inside its own
``__init__`` (so every role sees the rank's environment) and keeps them in
``fused_worker_dict``. A group built from it hosts all roles in one object per rank;
``WorkerGroup.spawn(roles)`` gives one role group per role and
``WorkerGroup.fuse(roles)`` sets them as attributes (``wg.actor.add(...)``).

A role group shares the colocated group's ranks, connection and failure state. It
binds the role class's registered methods under their own names and sends each call
as ``"<role>_<method>"``, the name under which the colocated instance answers for that
role's method (verl's ``{prefix}_{method}``). So a call on a role group takes the same
path as any group call: dispatch (with the role's dispatch mode and the role's mesh
info) → send → host → collect.

Mirrors verl's ``create_colocated_worker_cls`` / ``create_colocated_worker_raw_cls``
and ``RayWorkerGroup.spawn`` / ``fuse``, without classes generated at run time: one
plain class resolves ``"<role>_<method>"`` by looking the role up in its dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..worker import ClassWithInitArgs, Worker

__all__ = ["ColocatedWorker", "create_colocated_worker_cls"]


class ColocatedWorker(Worker):
    """One rank that hosts several roles (verl's ``WorkerDict`` / ``FusedWorker``).

    Args:
        roles: role name → [`ClassWithInitArgs`][daskwg.ClassWithInitArgs] (or a class). Every role is
            instantiated here, in order, after ``Worker.__init__`` read the rank's
            environment, so each role instance sees the same ``RANK``/``WORLD_SIZE``/...

    Attributes:
        fused_worker_dict: role name → role instance. Role instances that are
            [`Worker`][daskwg.Worker] objects share this dict, so a role reaches another with
            ``self.get_fused_worker_by_name("critic")`` (as in verl).

    ``instance.<role>`` is the role instance and ``instance.<role>_<method>`` its method
    (the name role groups send). Subclass it to add methods that combine roles
    (verl's fused-worker pattern)::

        class Hybrid(ColocatedWorker):
            def __init__(self):
                super().__init__({"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic, 10)})

            @register(dispatch_mode=Dispatch.ONE_TO_ALL)
            def step(self, x):
                return self.critic.sub(self.actor.add(x))

    Raises:
        ValueError: no roles, or a role name that is not an identifier, starts with
            ``_`` or clashes with an attribute of the class.
        TypeError: a role that is neither a class nor a ``ClassWithInitArgs``.
    """

    def __init__(self, roles: Mapping[str, type | ClassWithInitArgs]):
        super().__init__()
        roles = _check_roles(roles, type(self))
        self._role_classes = {role: cwi.cls for role, cwi in roles.items()}
        for role, cls_with_init in roles.items():
            self.fused_worker_dict[role] = cls_with_init()
        for instance in self.fused_worker_dict.values():
            if isinstance(instance, Worker):
                instance.fused_worker_dict = self.fused_worker_dict

    def role_classes(self) -> dict[str, type]:
        """Role name → the role's class, in the order the roles were given.

        The driver asks rank 0 for this when it spawns role groups, so a group
        reattached with ``WorkerGroup.attach`` can spawn them too.
        """
        return dict(self._state("_role_classes"))

    def __getattr__(self, name: str) -> Any:
        # Reached only for names that are not ordinary attributes.
        if name.startswith("__"):
            raise AttributeError(name)
        roles = self.__dict__.get("fused_worker_dict")
        if not roles:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if name in roles:
            return roles[name]
        # Longest role name first, so "actor_rollout_x" means role "actor_rollout".
        for role in sorted(roles, key=len, reverse=True):
            prefix = f"{role}_"
            if name.startswith(prefix) and hasattr(roles[role], name[len(prefix) :]):
                return getattr(roles[role], name[len(prefix) :])
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}; its roles are {sorted(roles)} "
            "and role methods are reached as '<role>_<method>'"
        )


def _check_roles(roles: Any, colocated_cls: type) -> dict[str, ClassWithInitArgs]:
    if not isinstance(roles, Mapping):
        raise TypeError(f"roles must be a dict of role name to class, got {type(roles).__name__}")
    if not roles:
        raise ValueError("a colocated worker needs at least one role")
    out = {}
    for role, value in roles.items():
        if not isinstance(role, str) or not role.isidentifier() or role.startswith("_"):
            raise ValueError(f"role names must be identifiers not starting with '_', got {role!r}")
        if hasattr(colocated_cls, role):
            raise ValueError(
                f"role name {role!r} clashes with the attribute {colocated_cls.__name__}.{role}; rename the role"
            )
        if isinstance(value, ClassWithInitArgs):
            out[role] = value
        elif isinstance(value, type):
            out[role] = ClassWithInitArgs(value)
        else:
            raise TypeError(
                f"role {role!r} must be a class or a ClassWithInitArgs, got {type(value).__name__}"
            )
    return out


def create_colocated_worker_cls(class_dict: Mapping[str, type | ClassWithInitArgs]) -> ClassWithInitArgs:
    """The class of a group whose every rank hosts all roles of ``class_dict``.

    Args:
        class_dict: role name → role class or [`ClassWithInitArgs`][daskwg.ClassWithInitArgs] (its init
            arguments are used for that role on every rank).

    Returns:
        ``ClassWithInitArgs(ColocatedWorker, roles)``: pass it to [`WorkerGroup`][daskwg.WorkerGroup],
        then ``wg.spawn(class_dict.keys())`` or ``wg.fuse(class_dict.keys())``.

    Raises:
        ValueError, TypeError: as [`ColocatedWorker`][daskwg.groups.colocate.ColocatedWorker], checked here in the
            driver.

    Mirrors verl's ``create_colocated_worker_cls`` (role methods are reached as
    ``"<role>_<method>"`` on each rank, as verl's ``{prefix}_{method}``).
    """
    roles = _check_roles(class_dict, ColocatedWorker)
    return ClassWithInitArgs(ColocatedWorker, roles)


def role_classes_of(cls_with_init: ClassWithInitArgs) -> dict[str, type] | None:
    """Role name → class of a colocated worker's ``ClassWithInitArgs`` (``None`` if it is
    not one), read in the driver: classes defined in ``__main__`` cannot make the trip
    back from a worker."""
    if not (isinstance(cls_with_init.cls, type) and issubclass(cls_with_init.cls, ColocatedWorker)):
        return None
    roles = cls_with_init.args[0] if cls_with_init.args else cls_with_init.kwargs.get("roles")
    if not isinstance(roles, Mapping):
        return None
    return {role: (r.cls if isinstance(r, ClassWithInitArgs) else r) for role, r in roles.items()}
