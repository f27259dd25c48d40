"""verl 0.9.1's own tests run against daskwg (``tests/verl_suite``), from the main test command.

Each suite runs in a child process (its ``ray`` stand-in must not leak into this one)
and writes a JUnit report; every verl test must pass, except the ones listed in
``stops.STOPS_AT``, which must stop exactly at the step named there.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "verl_suite"))

import suite  # noqa: E402
from stops import STOPS_AT  # noqa: E402


def _outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed / failed / skipped / xfailed}`` from a pytest JUnit report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_id = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            out[test_id] = "failed"
        elif skipped is not None:
            out[test_id] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            out[test_id] = "passed"
    return out


def _run(name: str, tmp_path: Path) -> dict[str, str]:
    report = tmp_path / f"{name}.xml"
    proc = suite.run(
        name, ["-q", "-p", "no:warnings", f"--junitxml={report}"], capture_output=True, text=True
    )
    assert report.exists(), f"verl's {name} suite did not run:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    outcomes = _outcomes(report)
    unexpected = {t: o for t, o in outcomes.items() if o != ("xfailed" if t in STOPS_AT else "passed")}
    assert not unexpected, f"verl tests with unexpected outcomes: {unexpected}\n{proc.stdout[-8000:]}"
    return outcomes


@pytest.mark.timeout(900)
def test_verl_single_controller_tests_pass_on_daskwg(tmp_path):
    outcomes = _run("single_controller", tmp_path)
    files = {t.split("::")[0].rsplit("/", 1)[-1] for t in outcomes}
    assert files == set(suite.SINGLE_CONTROLLER)
    assert len(outcomes) == 16


@pytest.mark.timeout(300)
def test_verl_protocol_tests_pass_on_daskwg_dataproto(tmp_path):
    outcomes = _run("protocol", tmp_path)
    assert len(outcomes) == 38


def test_every_verl_single_controller_test_file_is_run_or_left_out_with_a_reason():
    tree = suite.fetch()
    found = {p.name for p in (tree / "tests" / "single_controller").glob("test_*.py")}
    assert found == set(suite.SINGLE_CONTROLLER) | set(suite.LEFT_OUT)
    assert not set(suite.SINGLE_CONTROLLER) & set(suite.LEFT_OUT)


def test_the_main_test_process_keeps_the_real_ray():
    # The ray stand-in lives only in the suites' child processes: here verl's and daskwg's
    # comparison tests use the real ray (whose exit handler imports ray.dag).
    assert getattr(sys.modules.get("ray"), "__version__", "") != "0.0-daskwg-standin"
    assert "verl.single_controller.ray.base" not in sys.modules or not sys.modules[
        "verl.single_controller.ray.base"
    ].__doc__.startswith("stand-in")
