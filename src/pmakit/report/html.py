"""Render the report's blocks as one self-contained HTML file: CSS inline, plots as base64 PNG, no network."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path

from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1a1a1a;
       max-width: 1180px; margin: 2em auto; padding: 0 1.5em; background: #fff; }
h1 { font-size: 1.7em; border-bottom: 2px solid #0072B2; padding-bottom: .3em; }
h2 { font-size: 1.35em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
h3 { font-size: 1.1em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .85em; }
th, td { border: 1px solid #d0d7de; padding: .3em .5em; }
th { background: #f3f5f7; text-align: left; vertical-align: bottom; }
td.l { min-width: 7em; }
td.r { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafbfc; }
code { background: #f3f5f7; padding: .1em .3em; border-radius: 3px; font-size: .92em; }
.note { background: #fff8e1; border-left: 4px solid #E69F00; padding: .5em .9em; }
figure { margin: 1.2em 0 2em; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption p { margin: .35em 0; color: #333; font-size: .93em; }
.scroll { overflow-x: auto; }
"""


def _inline(text: str) -> str:
    """Escape, then allow `code` and **bold**."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _table(t: Table) -> str:
    align = (t.align or "l" + "r" * (len(t.header) - 1)).ljust(len(t.header), "l")
    head = "".join(f"<th>{_inline(h)}</th>" for h in t.header)
    body = "".join(
        "<tr>" + "".join(f'<td class="{a}">{_inline(c)}</td>' for a, c in zip(align, row)) + "</tr>"
        for row in t.rows
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _figure(f: FigureBlock, run_dir: Path) -> str:
    data = base64.b64encode((run_dir / f.path).read_bytes()).decode("ascii")
    caption = "".join(f"<p>{_inline(c)}</p>" for c in f.caption)
    return (
        f"<h3>{_inline(f.title)}</h3><figure>"
        f'<img src="data:image/png;base64,{data}" alt="{html.escape(f.title)}">'
        f"<figcaption>{caption}</figcaption></figure>"
    )


def render(blocks: Sequence[Block], run_dir: Path) -> str:
    """The whole document as one HTML page; plot files are read from ``run_dir`` and embedded."""
    title = next((b.text for b in blocks if isinstance(b, Heading) and b.level == 1), "PMA experiment report")
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Paragraph):
            parts.append(f'<p class="note">{_inline(b.text)}</p>' if b.note else f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            parts.append(_table(b))
        elif isinstance(b, FigureBlock):
            parts.append(_figure(b, run_dir))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )
