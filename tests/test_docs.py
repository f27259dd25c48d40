"""The documentation: every code block runs (or says it does not), and the built site's
API reference names every public name."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import daskwg

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# A fenced block: its language, its first line's number in the file, its text.
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = "# not run"


def code_blocks(page: Path) -> list[tuple[str, int, str]]:
    text = page.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text)]


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    return [
        (line, code)
        for lang, line, code in code_blocks(page)
        if lang == "python" and not code.lstrip().startswith(NOT_RUN)
    ]


PAGES = sorted(p for p in DOCS.glob("*.md") if runnable_blocks(p))


def test_every_code_block_runs_or_is_marked_as_not_run():
    unmarked = [
        f"{page.name}:{line} ({lang or 'no language'})"
        for page in sorted(DOCS.glob("*.md"))
        for lang, line, code in code_blocks(page)
        if lang != "python" and not code.lstrip().startswith(NOT_RUN)
    ]
    assert not unmarked, f"code blocks neither in python nor starting with {NOT_RUN!r}: {unmarked}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_code_runs(page, client4):
    """The page's python blocks run in order in one namespace, as a reader would paste
    them into one session, with ``client`` connected to the shared 4-worker cluster."""
    namespace = {"__name__": "__main__", "client": client4}
    for line, code in runnable_blocks(page):
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the code block at {page.name}:{line} failed: {exc!r}") from exc


@pytest.fixture(scope="module")
def api_reference(tmp_path_factory) -> str:
    """The HTML of the built site's API reference (``mkdocs build --strict``, as ``tox -e docs``)."""
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["NO_MKDOCS_2_WARNING"] = "1"
    site = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return (site / "api" / "index.html").read_text()


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.timeout(600)
def test_api_reference_names_every_public_name(api_reference):
    missing = [name for name in daskwg.__all__ if f'id="daskwg.{name}"' not in api_reference]
    assert not missing, f"names of daskwg.__all__ missing from the API reference: {missing}"


@pytest.mark.timeout(600)
def test_api_reference_links_names_instead_of_showing_sphinx_roles(api_reference):
    roles = re.findall(r":(?:class|meth|func|attr|data|exc|mod):`?\w", _text(api_reference))
    assert roles == [], f"raw Sphinx roles in the API reference: {roles[:10]}"
    # The cross-references are links: WorkerGroup's docstring links to ClassWithInitArgs.
    start = api_reference.index('id="daskwg.WorkerGroup"')
    assert 'href="#daskwg.ClassWithInitArgs"' in api_reference[start : start + 20000]


@pytest.mark.timeout(600)
def test_a_returns_text_over_several_lines_is_one_row_of_the_returns_table(api_reference):
    start = api_reference.index('id="daskwg.create_colocated_worker_cls"')
    returns = api_reference[start:].split("Returns:", 1)[1].split("</table>", 1)[0]
    assert returns.count("<tr") == 2, returns  # the header and one value
    assert "wg.spawn(class_dict.keys())" in _text(returns)
