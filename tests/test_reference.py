"""The reference a user reads without building anything: docstring sections that parse
(as mkdocstrings renders them), the rank-side collective functions in the API reference
and the README, and every setting of ``daskwg/daskwg.yaml`` in the README's table.

No cluster: these run in seconds.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RANK_SIDE_COLLECTIVES = (
    "broadcast",
    "allreduce",
    "allgather",
    "barrier",
    "get_rank",
    "get_group",
    "get_collective_group_size",
)


DOCSTRING_WARNING = re.compile(r"^\S+\.py:\d+: ")


def _mkdocstrings_options() -> tuple[set[str], dict]:
    """The private names mkdocs.yml renders anyway, and its docstring parser options."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    python = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    options = python["handlers"]["python"]["options"]
    kept = {f[2:-1] for f in options["filters"] if f.startswith("^_")}
    return kept, dict(options.get("docstring_options", {}))


def _public_objects(griffe, package) -> list:
    """Every module, class, function and attribute of ``package`` whose path has no
    private part (plus the private names mkdocs.yml shows), aliases left out (each
    object is checked where it is defined)."""
    kept, _ = _mkdocstrings_options()
    found = []

    def walk(obj) -> None:
        found.append(obj)
        for name, member in obj.members.items():
            if member.is_alias or (name.startswith("_") and name not in kept):
                continue
            walk(member)

    walk(package)
    return found


def docstring_problems() -> list[str]:
    """What griffe reports while parsing each public docstring as a Google docstring with
    mkdocs.yml's options: a section header it skipped (no blank line above it), an item it
    could not split into ``name: description``, a missing type."""
    griffe = pytest.importorskip("griffe")
    _, options = _mkdocstrings_options()
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    package = griffe.load("daskwg", search_paths=[str(ROOT)], allow_inspection=False)
    logger = logging.getLogger("griffe")
    handler, level, propagate = Collect(), logger.level, logger.propagate
    # Griffe logs a skipped section at DEBUG level (it cannot tell it from prose).
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        problems = []
        for obj in _public_objects(griffe, package):
            if obj.docstring is None:
                continue
            start = len(messages)
            obj.docstring.parse("google", warnings=True, **options)
            # Griffe's docstring warnings start with the docstring's file and line; the
            # others (a base class from the standard library it did not load) are not
            # about docstrings.
            problems += [f"{obj.path}: {m}" for m in messages[start:] if DOCSTRING_WARNING.match(m)]
        return problems
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def test_every_public_docstring_s_sections_parse_as_google_sections():
    problems = docstring_problems()
    assert problems == [], "docstring sections that do not render (griffe):\n" + "\n".join(problems)


def test_a_section_without_a_blank_line_above_it_is_reported(tmp_path, monkeypatch):
    griffe = pytest.importorskip("griffe")
    (tmp_path / "broken.py").write_text(
        'def f(x):\n    """Do it.\n    Returns:\n        x.\n    Raises:\n        ValueError: never.\n    """\n'
    )
    messages = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("griffe")
    monkeypatch.setattr(logger, "level", logging.DEBUG)
    handler = Collect()
    logger.addHandler(handler)
    try:
        module = griffe.load("broken", search_paths=[str(tmp_path)], allow_inspection=False)
        module["f"].docstring.parse("google", warnings=True)
    finally:
        logger.removeHandler(handler)
    assert any("Missing blank line above section" in m for m in messages), messages


def test_the_api_reference_lists_the_rank_side_collective_functions():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import api
    finally:
        sys.path.remove(str(ROOT / "docs" / "_hooks"))
    blocks = set(re.findall(r"^::: (\S+)$", api.api_markdown(), re.M))
    missing = [n for n in RANK_SIDE_COLLECTIVES if f"daskwg.collective.{n}" not in blocks]
    assert missing == [], f"daskwg.collective functions missing from the API reference: {missing}"


def test_the_readme_lists_the_rank_side_collective_functions():
    missing = [n for n in RANK_SIDE_COLLECTIVES if not re.search(rf"^\| `{n}\(", README, re.M)]
    assert missing == [], f"daskwg.collective functions missing from the README's table: {missing}"


def _settings(tree: dict, prefix: str = "daskwg.") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_the_readme_configuration_table_has_every_setting_with_its_default():
    defaults = _settings(yaml.safe_load((ROOT / "daskwg" / "daskwg.yaml").read_text())["daskwg"])
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    table = {
        key: yaml.safe_load(default)
        for key, default in re.findall(r"^\| `(daskwg\.[\w.-]+)` \| `([^`]*)` \|", section, re.M)
    }
    assert sorted(set(defaults) - set(table)) == [], "settings of daskwg.yaml missing from the README's table"
    assert sorted(set(table) - set(defaults)) == [], "README rows naming no setting of daskwg.yaml"
    wrong = {k: (table[k], v) for k, v in defaults.items() if table[k] != v}
    assert wrong == {}, "README default differs from daskwg.yaml: {key: (README, yaml)}"


def run_pytest_on_a_test_that_times_out(tmp_path, *plugins: str) -> str:
    import os
    import subprocess

    (tmp_path / "test_slow.py").write_text(
        "import threading, time\n"
        "def test_fast():\n    pass\n"
        "def test_sleeps_past_its_timeout():\n"
        "    threading.Thread(target=time.sleep, args=(30,), name='sleeper', daemon=True).start()\n"
        "    time.sleep(30)\n"
        "def test_after():\n    pass\n"
    )
    options = [arg for plugin in plugins for arg in ("-p", plugin)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *options, "--timeout", "2"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run.stdout


def test_a_timeout_s_thread_dump_is_in_the_failing_test_s_report(tmp_path):
    """Even with output not captured (``-s``, or a fixture's phase when capture is
    suspended), where pytest-timeout alone writes the dump between the progress dots."""
    out = run_pytest_on_a_test_that_times_out(tmp_path, "timeout_report")
    assert "1 failed, 2 passed" in out, out
    before, failures = out.split("= FAILURES =", 1)
    assert "sleeper" not in before and "Timeout" not in before, before
    assert "Timeout >2s in test_slow.py::test_sleeps_past_its_timeout" in failures
    assert "--- thread sleeper" in failures


def _verl_extra() -> list:
    import configparser

    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.extras_require"]["verl"].strip().splitlines()
    return [Requirement(line) for line in lines if line.strip()]


def test_the_verl_extra_is_installed_here_with_the_versions_it_names():
    """tox installs daskwg with the ``verl`` extra: every requirement it names is met."""
    from importlib.metadata import PackageNotFoundError, version

    unmet = []
    for requirement in _verl_extra():
        try:
            found = version(requirement.name)
        except PackageNotFoundError:
            found = None
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement} (installed: {found})")
    assert unmet == []


def test_verl_s_single_controller_and_dataproto_import_with_the_verl_extra():
    """What the extra is for: verl (installed with ``--no-deps``) imports on CPU, its Ray
    single-controller module and ``daskwg.verl`` included, in this environment (daskwg's
    requirements and its ``test`` and ``verl`` extras, as tox installs them)."""
    import subprocess

    pytest.importorskip("verl")
    code = (
        "import verl.protocol, verl.single_controller.base, verl.single_controller.base.decorator\n"
        "import verl.single_controller.ray\n"
        "import daskwg.verl\n"
        "print('imported')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-3000:]
