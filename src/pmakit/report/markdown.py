"""Render the report's blocks as GitHub-flavoured Markdown (plots linked by relative path)."""

from __future__ import annotations

from collections.abc import Sequence

from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(t: Table) -> list[str]:
    align = t.align or "l" + "r" * (len(t.header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align.ljust(len(t.header), "l")]
    lines = ["| " + " | ".join(_cell(h) for h in t.header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t.rows]
    return lines


def render(blocks: Sequence[Block]) -> str:
    """The whole document as Markdown text."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Paragraph):
            out.append(f"> **Note:** {b.text}" if b.note else b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Table):
            out.append("\n".join(_table(b)))
        elif isinstance(b, FigureBlock):
            out.append(f"### {b.title}")
            out.append(f"![{b.title}]({b.path.as_posix()})")
            out.extend(b.caption)
    return "\n\n".join(out) + "\n"
