"""The summary table both demos print: one row per measure, its name dimmed, its value beside it, no borders.

Owns `summary_table`. Rendering only; it keeps no state. Called by synthetic.py (`kvstage demo --synthetic`) and
vllm.py (`kvstage demo`).
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table


def summary_table(rows: Iterable[tuple[str, str]], title: str | None = None) -> Table:
    """A two-column table of (measure, value) rows, under `title` if one is given."""
    table = Table(title=title, show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table
