"""Every page of the site is reachable: each page in ``docs/`` is in the navigation, the home
page links every tutorial, how-to guide and concept page, and the navigation's top level is
tutorials / how-to guides / concepts / reference (read from ``mkdocs.yml`` and the Markdown
sources)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _nav() -> list:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]


def _pages(entry: object) -> list[str]:
    """The page paths under a nav entry (a string, a {title: ...} mapping or a list)."""
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, dict):
        return [page for value in entry.values() for page in _pages(value)]
    if isinstance(entry, list):
        return [page for item in entry for page in _pages(item)]
    return []


def _section(title: str) -> list[str]:
    return next(_pages(e[title]) for e in _nav() if isinstance(e, dict) and title in e)


def test_every_page_in_docs_is_in_the_navigation():
    stored = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    in_nav = set(_pages(_nav()))
    assert stored - in_nav == set(), "add these pages to mkdocs.yml's nav"


def test_the_navigation_is_tutorials_how_to_concepts_reference():
    top = [next(iter(e)) if isinstance(e, dict) else e for e in _nav()]
    assert top[:5] == ["Home", "Tutorials", "How-to guides", "Concepts", "Reference"], top


def test_the_home_page_links_every_tutorial_guide_and_concept():
    home = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", home))
    for section in ("Tutorials", "How-to guides", "Concepts"):
        pages = {p for p in _section(section) if p.endswith(".md")}
        assert pages, f"mkdocs.yml has no {section!r} section"
        assert pages - linked == set(), f"link these {section} pages from docs/index.md"


def test_the_checks_see_what_they_forbid():
    assert _pages([{"A": "a.md"}, {"B": [{"C": "c.md"}, "d.md"]}]) == ["a.md", "c.md", "d.md"]
    assert re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", "[x](a.md#y) [z](b.md)") == ["a.md", "b.md"]
