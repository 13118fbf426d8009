"""The report's neutral blocks (headings, paragraphs, bullets, tables, figures): every section builds a list of
them, and markdown.py and html.py render the same list, so both say exactly the same thing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    """A section title."""

    text: str
    """The title."""
    level: int = 2
    """1 for the document title, 2 for sections, 3 for subsections."""


@dataclass(frozen=True)
class Paragraph:
    """Plain text; `code` and **bold** are the only inline markup."""

    text: str
    """The text."""
    note: bool = False
    """Shown as a warning box (missing data and the like)."""


@dataclass(frozen=True)
class Bullets:
    """A bulleted list."""

    items: list[str]
    """One string per bullet."""


@dataclass(frozen=True)
class Table:
    """A table of already formatted cells."""

    header: list[str]
    """Column titles."""
    rows: list[list[str]]
    """Cells, row by row."""
    align: str = ""
    """One character per column, 'l' or 'r' (default: first column left, the rest right)."""


@dataclass(frozen=True)
class FigureBlock:
    """A plot with a title and a caption."""

    path: Path
    """The PNG, relative to the run directory."""
    title: str
    """Short title."""
    caption: list[str] = field(default_factory=list)
    """Caption paragraphs: what the figure shows, what the paper found, what this run shows."""


Block = Heading | Paragraph | Bullets | Table | FigureBlock
