"""Functions the tests run in the scheduler (``client.run_on_scheduler``); a module of its
own, importing nothing beyond the standard library, so a scheduler without torch can
import them by reference (a test module imports torch)."""

from __future__ import annotations


def import_torch(dask_scheduler) -> None:
    """Import torch in the scheduler (raises there if it cannot)."""
    import torch  # noqa: F401


def plugin_names(dask_scheduler) -> list[str]:
    """The names of the scheduler's plugins."""
    return sorted(dask_scheduler.plugins)


def loaded(names: list[str], dask_scheduler=None) -> list[str]:
    """Which of the modules ``names`` the scheduler process has imported."""
    import sys

    return sorted(n for n in names if n in sys.modules)
