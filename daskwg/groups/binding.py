"""What every group of ranks has: its class's registered methods bound as attributes,
and verl's ``execute_*`` calls: :class:`BoundGroup`, the base of
:class:`~daskwg.groups.group.WorkerGroup` and of the role groups of colocation.

A call of a bound method runs verl's three steps: **dispatch** (the mode's
``dispatch_fn`` splits the arguments per rank, ``daskwg.dispatch.modes``), **execute** (the group
sends one call per rank, ``daskwg.transport``) and **collect** (the mode's ``collect_fn``
merges the per-rank results; padding added by the dispatch is taken off,
:func:`daskwg.futures.padding.unpad`). Mirrors verl's ``WorkerGroup._bind_worker_method``
and ``RayWorkerGroup``'s ``execute_*``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from distributed import Future

from .. import plans
from ..dispatch.calling import collect, cut
from ..dispatch.modes import split_or_broadcast
from ..dispatch.register import Execute, RegisteredMethod, get_predefined_dispatch_fn, get_registered_method

__all__ = ["BoundGroup", "split_or_broadcast"]

#: Attributes of a group that no registered method may shadow.
RESERVED = frozenset({"_dispatch_info", "_collect_info", "_client", "_slots", "_methods", "_cls", "_name"})


class BoundGroup:
    """A set of ranks whose class's registered methods are bound as attributes.

    Subclasses set ``_cls`` (the class whose methods are bound), ``_name``,
    ``_dispatch_info`` and ``_collect_info`` (mesh caches), call
    :meth:`_bind_registered_methods`, and provide ``world_size``, :meth:`_check_usable`,
    :meth:`_deliver` and :meth:`_gather_any`.
    """

    _cls: type
    _name: str
    _methods: dict[str, RegisteredMethod]
    _dispatch_info: dict[str, list[int]]
    _collect_info: dict[str, list[bool]]

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def method_names(self) -> list[str]:
        """Names of the registered methods bound on this group."""
        return sorted(self._methods)

    # ---- verl's execute_* ------------------------------------------------------------

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method_name`` on every rank and wait; returns the per-rank results.

        An argument that is a list of exactly ``world_size`` items (all arguments
        being such lists) is split one item per rank; otherwise every rank gets every
        argument, as verl's ``execute_all_async`` does.
        """
        return self._execute_all(method_name, args, kwargs, blocking=True)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Future]:
        """As :meth:`execute_all_sync` but returns one ``distributed.Future`` per rank."""
        return self._execute_all(method_name, args, kwargs, blocking=False)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Future]:
        """Alias of :meth:`execute_all_async`, as in verl."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` on rank 0 only and return its result."""
        return self._send(method_name, [0], [(args, kwargs)], blocking=True)[0]

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``method_name`` on rank 0 only; returns its ``distributed.Future``."""
        return self._send(method_name, [0], [(args, kwargs)], blocking=False)[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Future:
        """Alias of :meth:`execute_rank_zero_async`, as in verl."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    # ---- binding and calling ---------------------------------------------------------

    def _bind_registered_methods(self) -> dict[str, RegisteredMethod]:
        methods = {}
        for attr_name, attr in inspect.getmembers(self._cls):
            registered = get_registered_method(attr)
            if registered is None:
                continue
            if attr_name in RESERVED or any(attr_name in vars(c) for c in type(self).__mro__):
                raise ValueError(
                    f"{self._cls.__name__}.{attr_name} is registered but clashes with the WorkerGroup "
                    "attribute of that name; rename the method"
                )
            bound = functools.partial(self._call_registered, attr_name, registered)
            functools.update_wrapper(bound, attr)
            setattr(self, attr_name, bound)
            methods[attr_name] = registered
        return methods

    def _dispatch_fns(self, registered: RegisteredMethod) -> dict[str, Any]:
        """The ``{"dispatch_fn", "collect_fn"}`` a call of ``registered`` runs with: its mode's
        (``daskwg.verl``'s groups give ``ALL_TO_ALL`` verl's meaning here)."""
        return get_predefined_dispatch_fn(registered.dispatch_mode)

    def _call_registered(
        self, method_name: str, registered: RegisteredMethod, *args: Any, **kwargs: Any
    ) -> Any:
        step = plans.recording()
        if step is not None:  # inside daskwg.plan(): recorded, run when the step is replayed
            return step.record(self, method_name, registered, args, kwargs)
        fns = self._dispatch_fns(registered)
        self._at_call_boundary()
        self._check_usable(method_name)
        ranks = [0] if registered.execute_mode == Execute.RANK_ZERO else list(range(self.world_size))
        payloads, pad_size = cut(self, method_name, fns, args, kwargs, ranks)
        if payloads:
            self._check_arguments(method_name, *payloads[0])
        # The group lets go of the parts, so concatenation can free each one as it goes.
        return collect(
            self,
            method_name,
            registered,
            fns,
            self._send(
                method_name,
                ranks,
                payloads,
                blocking=registered.blocking,
                timeout=registered.timeout,
                concurrency_group=registered.concurrency_group,
            ),
            ranks,
            pad_size,
        )

    def _execute_all(self, method_name: str, args: tuple, kwargs: dict, *, blocking: bool) -> list:
        self._at_call_boundary()
        n = self.world_size
        d_args, d_kwargs = split_or_broadcast(self, *args, **kwargs)
        payloads = [(tuple(a[r] for a in d_args), {k: v[r] for k, v in d_kwargs.items()}) for r in range(n)]
        return self._send(method_name, list(range(n)), payloads, blocking=blocking)

    def _send(
        self, method_name: str, ranks: list[int], payloads: list, *, check: bool = True, **options: Any
    ) -> list:
        """Send one call to each of ``ranks`` (:meth:`_deliver`), after checking (unless
        ``check`` is false, as for shutdown) that the group is usable and has the method.

        Raises:
            GroupBrokenError, WorkerLostError: the group is not usable.
            AttributeError: the class has no such method.
        """
        if check and plans.recording() is not None:
            raise RuntimeError(
                f"{self._name}.{method_name}: a step plan records the group's registered methods, not "
                "execute_* calls or shutdown; make this call outside the with daskwg.plan() block"
            )
        if check:
            self._check_usable(method_name)
            if method_name not in self._methods and not hasattr(self._cls, method_name):
                raise AttributeError(
                    f"{self._describe_class()} has no method {method_name!r}; registered methods: "
                    f"{sorted(self._methods)}"
                )
        return self._deliver(method_name, ranks, payloads, check=check, **options)

    def _describe_class(self) -> str:
        return self._cls.__name__

    def _check_arguments(self, method_name: str, args: tuple, kwargs: dict) -> None:
        """Refuse, before any rank runs, arguments the method's signature does not take (a
        missing, extra or misspelt one), as calling it on a rank would.

        Raises:
            TypeError: the method cannot be called with them (the message gives its signature).
        """
        signatures = self.__dict__.setdefault("_signatures", {})
        if method_name not in signatures:
            signatures[method_name] = method_signature(self._cls, method_name)
        signature = signatures[method_name]
        if signature is None:
            return
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"{self._describe_class()}.{method_name}{_without_self(signature)} cannot take the arguments "
                f"of this call ({exc}); nothing was sent to the ranks. Check the call's arguments against "
                "the method's signature (a dispatch mode passes each rank its share of every argument)"
            ) from None

    def _at_call_boundary(self) -> None:
        """Before a call is cut into per-rank payloads: where the group may change its
        membership (a group that follows its pool); nothing by default."""

    def _check_usable(self, method_name: str) -> None:
        raise NotImplementedError

    def _deliver(self, method_name: str, ranks: list[int], payloads: list, **options: Any) -> list:
        raise NotImplementedError

    def _gather_any(self, futures: list) -> list:
        raise NotImplementedError

    def __getattr__(self, item: str) -> Any:
        # Only reached for names that are not attributes: unknown methods.
        if item.startswith("__") or item in ("_methods", "_cls"):
            raise AttributeError(item)
        methods = self.__dict__.get("_methods", {})
        cls = self.__dict__.get("_cls")
        cls_name = cls.__name__ if cls is not None else "the worker class"
        hint = (
            f"{cls_name}.{item} exists but is not decorated with @register"
            if cls is not None and hasattr(cls, item)
            else f"{cls_name} has no method {item!r}"
        )
        raise AttributeError(
            f"WorkerGroup has no attribute {item!r}: {hint}; registered methods: {sorted(methods)}"
        )


def method_signature(cls: Any, method_name: str) -> inspect.Signature | None:
    """The signature of ``cls``'s function ``method_name`` (``self`` first), or ``None``
    where there is none to check against (no such plain function, a builtin, or one that
    takes anything: ``*args, **kwargs``)."""
    function = inspect.getattr_static(cls, method_name, None)
    if isinstance(function, (staticmethod, classmethod)) or not callable(function):
        return None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in signature.parameters.values()}
    if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return None
    if not signature.parameters:
        return None
    return signature


def _without_self(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])
