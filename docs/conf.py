"""Sphinx configuration: the Markdown pages of docs/ (MyST) and the API reference generated from the docstrings.

Build (what CI runs, warnings are errors): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
A broken cross-reference between pages, a missing anchor or a docstring that does not parse fails the build.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

project = "partialvfl"
author = "The partialvfl authors"
copyright = "2026, The partialvfl authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# the generated message reference nests its per-kind tables under H4 headings; heading levels are style, not links
# The generated report fragments under results/ are linked from the pages, not listed in a table of contents.
suppress_warnings = ["myst.header", "toc.not_included"]

autosummary_generate = True
autosummary_imported_members = False
# a module documents what it defines; names re-exported by a package (its __all__) are documented where they live
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "partialvfl"


_HTML_ANCHOR = re.compile(r'^<a id="([A-Za-z0-9_-]+)"></a>', flags=re.MULTILINE)


def _html_anchors_as_targets(app: object, docname: str, source: list[str]) -> None:
    """A paragraph's ``<a id="x"></a>`` (GitHub's anchor) becomes a MyST target ``(x)=``, so links to it resolve."""
    source[0] = _HTML_ANCHOR.sub(lambda m: f"({m.group(1)})=\n", source[0])


_LITERAL = re.compile(r"(``.*?``)")


def _plain_bars(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """Docstrings write set sizes as ``|O|``: outside literals and tables a bar is a bar, not a substitution."""
    for i, line in enumerate(lines):
        if "|" in line and not line.lstrip().startswith(("|", "+")):
            parts = _LITERAL.split(line)
            lines[i] = "".join(p if p.startswith("``") else p.replace("|", "\\|") for p in parts)


_RELATIVE_ROLE = re.compile(r"(:(?:mod|class|func|meth|attr|obj|data|exc):`~?)\.(?=[A-Za-z_])")


def _absolute_references(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """``:mod:`.party``` means the sibling module, as in a Python import (Sphinx would search every ``*.party``)."""
    module_name = name if what == "module" else getattr(obj, "__module__", None) or name.rpartition(".")[0]
    module = sys.modules.get(module_name)
    base = module_name if module is not None and hasattr(module, "__path__") else module_name.rpartition(".")[0]
    for i, line in enumerate(lines):
        lines[i] = _RELATIVE_ROLE.sub(lambda m: f"{m.group(1)}{base}.", line)


def _skip_sklearn_routing(app: object, what: str, name: str, obj: object, skip: bool, options: object) -> bool | None:
    """scikit-learn's generated ``set_*_request`` methods are its metadata routing, not this package's API."""
    return True if name.startswith("set_") and name.endswith("_request") else None


def setup(app: object) -> None:
    """Register the anchor rewrite and the docstring fixes."""
    app.connect("source-read", _html_anchors_as_targets)  # type: ignore[attr-defined]
    app.connect("autodoc-process-docstring", _plain_bars)  # type: ignore[attr-defined]
    app.connect("autodoc-process-docstring", _absolute_references)  # type: ignore[attr-defined]
    app.connect("autodoc-skip-member", _skip_sklearn_routing)  # type: ignore[attr-defined]
