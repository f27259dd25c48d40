"""``@register`` and the dispatch modes, where verl's ``decorator`` module has them.

The face of :mod:`daskwg.dispatch.register`, which holds the code; verl code that imports
``Dispatch``, ``Execute`` and ``register`` from ``decorator`` finds them here too.
"""

from .dispatch.register import *  # noqa: F403
from .dispatch.register import __all__  # noqa: F401
