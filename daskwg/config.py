"""daskwg's settings, in Dask's configuration under the ``daskwg`` namespace.

Defaults live in ``daskwg.yaml`` beside this module; override them like any Dask
setting (``dask.config.set({"daskwg.poll-interval": 0.5})``, a YAML file in
``~/.config/dask/``, or ``DASK_DASKWG__POLL_INTERVAL=0.5``).
"""

from __future__ import annotations

import os

import dask.config
import yaml

_path = os.path.join(os.path.dirname(__file__), "daskwg.yaml")
with open(_path) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)
