"""Every page of the site is reachable: each page in ``docs/`` is in the navigation, and the home
page links every page of the user guide (read from ``mkdocs.yml`` and the Markdown sources)."""

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


def test_the_home_page_links_every_user_guide_page():
    home = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", home))
    guide = set(_section("User guide"))
    assert guide, "mkdocs.yml has no 'User guide' section"
    assert guide - linked == set(), "link these user-guide pages from docs/index.md"


def test_the_checks_see_what_they_forbid():
    assert _pages([{"A": "a.md"}, {"B": [{"C": "c.md"}, "d.md"]}]) == ["a.md", "c.md", "d.md"]
    assert re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", "[x](a.md#y) [z](b.md)") == ["a.md", "b.md"]
