"""Dispatch → execute → collect, as verl's ``single_controller.base.decorator`` has them.

* ``register``: ``@register``, ``Dispatch``, ``Execute``, the registry of dispatch modes
  (``daskwg.decorator`` is its face at the top of the package).
* ``modes``: the dispatch and collect functions of every predefined mode.
* ``calling``: a call's first and last steps (``cut`` and ``collect``), shared by a call
  made alone and a step plan's replay.

The names of ``modes`` are re-exported here, where ``daskwg.dispatch`` named them before it
became a package.
"""

from .modes import *  # noqa: F403
from .modes import __all__  # noqa: F401
