"""The front page stays a front page, and the documentation's links lead somewhere.

README.md is what a newcomer reads first: under 150 lines, exactly two set-up commands for a fresh machine
(``make demo``, ``make test``), and the topics behind links into docs/. Every relative link of the README and the
docs pages must name a file that exists and, with a ``#fragment``, a heading of that file (GitHub's anchors).
The command blocks themselves run in tests/test_readme.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_readme import README, ROOT, doc_pages, readme_blocks, shell_lines

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(github_anchor(m.group(1)))
    return out


def test_front_page_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines: move detail into a docs/ page"


def test_front_page_has_exactly_the_two_setup_commands() -> None:
    commands = [line for b in readme_blocks() if b.page == "README.md" for line in shell_lines(b.text)]
    assert commands == ["make demo", "make test"], commands


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_from_a_registry(page: Path) -> None:
    # pmakit is not published: an install command names the checkout (pip install -e ".[extra]").
    assert not re.search(r"pip install ['\"]?pmakit", page.read_text()), page


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (dest.suffix != ".md" or fragment not in anchors(dest)):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    unlinked = {name for name in pages if f"({name})" not in index}
    assert not unlinked, f"docs/README.md does not link {sorted(unlinked)}"


def test_the_link_checker_catches_a_broken_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [bad](#no-such) [gone](missing.md)\n")
    with pytest.raises(AssertionError, match="no such file") as info:
        monkeypatch.setattr("test_docs.ROOT", tmp_path)
        test_every_link_resolves(page)
    assert "#no-such" in str(info.value) and "#a-heading" not in str(info.value)
