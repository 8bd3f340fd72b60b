"""The docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/ reaches a file of the
repository (and, for a Markdown page, a heading or anchor it has), and the user docs cite no "issue N" a reader
cannot look up."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the pages a reader follows: the front door, the contributor's guide, the docs (generated report fragments aside)
#: and the dated measurement pages written by hand (the other pages under docs/results/ are generated reports)
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
         *(ROOT / "docs" / "results" / name for name in ("gpu.md", "serving-load.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:, ...


def _slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    headings = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_the_link_checker_sees_links_and_skips_code_and_urls(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](x.md#b) `[c](d.md)` [e](https://f.org)\n```\n[g](h.md)\n```\n![i](j.png)\n## Gap `K` (x, y)\n")
    assert _links(page) == ["x.md#b"]
    assert _anchors(page) == {"gap-k-x-y"}


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading or anchor)")
    assert not broken, "\n".join(broken)


def test_no_issue_numbers_in_the_user_docs() -> None:
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) if re.search(r"\bissues? #?\d+", line, re.I)]
    assert not found, "\n".join(found)
