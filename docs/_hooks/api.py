"""mkdocs hook: writes the API reference from ``daskwg.__all__`` at build time.

``docs/api.md`` holds the marker ``<!-- daskwg-api -->``; this hook replaces it with one
mkdocstrings block (``::: daskwg.<name>``) per public name, grouped by the module that
defines it, then the public module-level names of the modules users import directly.
A name added to ``daskwg.__all__`` appears without editing any page.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

MARKER = "<!-- daskwg-api -->"

# Modules whose own public names (their __all__) users reach as daskwg.<module>.<name>.
MODULES = (
    "daskwg.protocol",
    "daskwg.collective",
    "daskwg.groups.colocate",
    "daskwg.scheduler.dashboard",
    "daskwg.verl",
)


def api_markdown() -> str:
    import daskwg

    by_module: dict[str, list[str]] = defaultdict(list)
    for name in daskwg.__all__:
        module = getattr(getattr(daskwg, name), "__module__", None) or "daskwg"
        by_module[module].append(name)
    lines = []
    for module in sorted(by_module):
        lines += [f"## `{module}`", ""]
        for name in by_module[module]:
            lines += [f"::: daskwg.{name}", ""]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        extra = [n for n in getattr(module, "__all__", ()) if n not in daskwg.__all__]
        if extra:
            lines += [f"## Also in `{module_name}`", ""]
            for name in extra:
                lines += [f"::: {module_name}.{name}", ""]
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - mkdocs hook signature
    if MARKER in markdown:
        return markdown.replace(MARKER, api_markdown())
    return markdown
