"""A group call's first and last steps, shared by a call made alone
(``BoundGroup._call_registered``) and a step plan's replay (``daskwg.plans.replay``): ``cut``
(the mode's dispatch function splits the arguments per rank) and ``collect`` (its collect
function merges the per-rank results, the dispatch's padding taken off). Mirrors verl's
``WorkerGroup._bind_worker_method`` around ``execute_*``.

The padding count leaves the dispatch function's ``kwargs`` here (verl's contract for what a
dispatch function returns) and travels from ``cut`` to ``collect`` as :class:`Cut`'s
``padding``; ``daskwg.futures.padding`` holds the rule for both ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..errors import DispatchError
from ..futures import padding
from ..futures.future import DataProtoFuture
from .modes import RankOutputs, check_per_rank
from .register import Execute, RegisteredMethod

__all__ = ["Cut", "collect", "cut"]


class Cut(NamedTuple):
    """A call cut for its ranks (:func:`cut`).

    Attributes:
        payloads: per rank asked for, its ``(args, kwargs)``.
        padding: rows of padding the dispatch added, which :func:`collect` takes off.
    """

    payloads: list[tuple[tuple, dict]]
    padding: int


def cut(group: Any, method: str, fns: dict, args: tuple, kwargs: dict, ranks: list[int]) -> Cut:
    """Per rank in ``ranks`` its ``(args, kwargs)``, and the rows of padding the dispatch added.

    Returns:
        a :class:`Cut` (a ``(payloads, padding)`` tuple).

    Raises:
        DispatchError: the dispatch function refused the arguments (naming the call), or did
            not return one entry per rank.
    """
    try:
        d_args, d_kwargs = fns["dispatch_fn"](group, *args, **kwargs)
    except DispatchError:
        raise
    except (TypeError, ValueError, IndexError) as exc:
        raise DispatchError(f"{group._name}.{method}: {exc}") from exc
    d_kwargs, pad = padding.take(d_kwargs)
    check_per_rank(f"the dispatch function of {group._name}.{method}", group.world_size, d_args, d_kwargs)
    return Cut([(tuple(a[r] for a in d_args), {k: v[r] for k, v in d_kwargs.items()}) for r in ranks], pad)


def collect(
    group: Any, method: str, registered: RegisteredMethod, fns: dict, parts: list, ranks: list[int], pad: int
) -> Any:
    """The call's result from its ranks' parts (values, or futures of ``blocking=False``
    calls): rank 0's for ``Execute.RANK_ZERO``, else the collect function's, unpadded.

    ``parts`` is the caller's last reference to the parts, so concatenation can free each
    one as it goes.
    """
    # The method name and ranks let a collect error say whose outputs it was merging.
    outputs = RankOutputs(parts, method=method, ranks=ranks)
    del parts
    if registered.execute_mode == Execute.RANK_ZERO:
        return outputs[0]
    result = fns["collect_fn"](group, outputs)
    if result is outputs:
        result = list(result)
    if isinstance(result, DataProtoFuture):
        result = dataclasses.replace(result, gather=group._gather_any)
    return padding.unpad(result, pad)
