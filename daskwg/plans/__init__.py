"""Step plans: a step's calls recorded once and replayed with one message per worker.

* ``step``: ``daskwg.plan``, :class:`StepPlan`, :class:`PlanValue`.
* ``recorded``: what a recording keeps of each call.
* ``replay``: a replay, compiled (one message per worker) or call by call.

The names of ``step`` are re-exported here, where ``daskwg.plans`` named them before it
became a package.
"""

from .step import *  # noqa: F403
from .step import __all__  # noqa: F401
