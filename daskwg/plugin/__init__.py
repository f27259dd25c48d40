"""The worker side: the Dask ``WorkerPlugin`` that hosts the ranks of worker groups.

``HostPlugin`` (``host``) routes the comm handlers and runs the life cycle of hosted
ranks; ``sequencer`` keeps calls in the driver's order; ``rank_loop`` runs ``async def``
methods; ``exceptions`` shapes errors for the driver; ``rows`` serves and fetches rows of
``DataProtoFuture`` parts; ``task`` is the entry point of calls that come as Dask tasks;
``metrics`` counts the calls hosted here for the scheduler's ``/metrics``.
"""

from .host import HostPlugin
from .task import run_call

__all__ = ["HostPlugin", "run_call"]
