"""Result tables that fit an 80-column terminal.

`compact(table)` drops the frame and the cell padding (one space between columns, a rule under the
header) and keeps every right-aligned (number) column on one line: rich would rather fold a number
over two lines than cut it, and a column that may not fold is cut with '…', which the tests look for
on an 80-column console. Titles and captions still wrap.
"""

from __future__ import annotations

from rich import box
from rich.table import Table


def compact(table: Table) -> Table:
    """The same table in the narrow style; returns it, so `console.print(compact(t))` reads."""
    table.box = box.SIMPLE_HEAD
    table.show_edge = False
    table.padding = (0, 0)
    for column in table.columns:
        if column.justify == "right":
            column.no_wrap = True
    return table
