"""pytest plugin for verl's own tests (``suite.py`` loads it with ``-p verl_suite_plugin``).

Installs the stand-ins of the suite named by ``$DASKWG_VERL_SUITE`` before pytest
imports verl's test modules, and ends every test without the previous one's Dask client
(a test that fails before its ``ray.shutdown()`` must not leave its groups to the next).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest
from stops import STOPS_AT

SUITE = os.environ.get("DASKWG_VERL_SUITE", "single_controller")


def _install_protocol_standin() -> None:
    """``verl`` is a package whose ``DataProto`` and ``protocol`` are daskwg's; its other
    subpackages (``verl.utils``) load from the installed verl, whose ``__init__`` (which
    imports verl's own protocol) does not run."""
    import daskwg
    import daskwg.protocol

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed: pip install --no-deps verl==0.9.1 (see tox.ini)")
    verl = types.ModuleType("verl", "stand-in: verl.protocol is daskwg.protocol")
    verl.__path__ = list(spec.submodule_search_locations)
    verl.DataProto = daskwg.DataProto
    verl.protocol = daskwg.protocol
    sys.modules["verl"] = verl
    sys.modules["verl.protocol"] = daskwg.protocol


if SUITE == "single_controller":
    import standins

    standins.install()

    @pytest.fixture(autouse=True)
    def _fresh_client():
        yield
        standins.shutdown()

elif SUITE == "protocol":
    _install_protocol_standin()
else:
    raise RuntimeError(f"DASKWG_VERL_SUITE={SUITE!r}: expected single_controller or protocol")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    expected = STOPS_AT.get(item.nodeid)
    if expected is None or call.when != "call":
        return
    message, reason = expected
    if report.failed and message in str(call.excinfo.value):
        report.outcome = "skipped"
        report.wasxfail = reason
    elif report.passed:
        report.outcome = "failed"
        report.longrepr = f"expected to stop at {message!r} ({reason}), but passed: update STOPS_AT"
