"""A rich table whose columns fit the console it is drawn on, wrapping long cells between words
instead of cutting them: both acts' live tables are ``Grid``s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.cells import cell_len

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult


def _fit_widths(columns: Sequence[Sequence[str]], available: int) -> list[int]:
    """Content widths for columns of plain-text cells (header first, then one per row) summing
    to at most ``available``: each column as wide as its longest line if they all fit; else
    narrowed one cell at a time where the table grows the fewest lines (the widest first),
    never below its longest word; only when the longest words alone do not fit, narrower."""
    widths = [
        max(1, *(cell_len(line) for cell in col for line in cell.splitlines())) for col in columns
    ]
    words = [max(1, *(cell_len(w) for cell in col for w in cell.split())) for col in columns]

    def height(widths: list[int]) -> int:
        return sum(
            max(_wrapped_lines(col[r], w) for col, w in zip(columns, widths, strict=True))
            for r in range(len(columns[0]))
        )

    def narrowed(i: int) -> list[int]:
        return [w - 1 if j == i else w for j, w in enumerate(widths)]

    while sum(widths) > available:
        narrowable = [i for i, w in enumerate(widths) if w > words[i]]
        if not narrowable:
            break
        i = min(narrowable, key=lambda i: (height(narrowed(i)), -widths[i]))
        widths = narrowed(i)
    while sum(widths) > available and max(widths) > 1:
        widths[widths.index(max(widths))] -= 1
    return widths


def _wrapped_lines(text: str, width: int) -> int:
    """How many lines ``text`` takes wrapped between words at ``width`` cells (a longer word
    folded)."""
    lines = 0
    for line in text.splitlines() or [""]:
        used = 0
        lines += 1
        for word in line.split():
            n = cell_len(word)
            if used and used + 1 + n <= width:
                used += 1 + n
                continue
            if used:
                lines += 1
            lines += (n - 1) // width
            used = (n - 1) % width + 1
    return lines


@dataclass(slots=True, kw_only=True)
class Grid:
    """A table whose columns fit the console it is drawn on. Left to itself rich narrows the
    widest column first and cuts what no longer fits with "…": at 80 columns, pod, source and
    node names. Here no name or value is cut at 80 columns (``_fit_widths``: long cells wrap
    between words), and on a narrower console a word too long for its column folds onto the
    next line (``overflow="fold"``): nothing is ever cut."""

    title: str
    headers: tuple[str, ...]
    rows: list[tuple[str, ...]]
    """Rich markup, one cell per header."""
    right: frozenset[int] = frozenset()
    """Columns justified right."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(
            title=self.title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True
        )
        # Between two columns: a cell of padding, the separator, a cell of padding; none at the
        # edges (show_edge and pad_edge off).
        overhead = 3 * (len(self.headers) - 1)
        plain = [
            [header, *(Text.from_markup(row[i]).plain for row in self.rows)]
            for i, header in enumerate(self.headers)
        ]
        widths = _fit_widths(plain, options.max_width - overhead)
        for i, (header, width) in enumerate(zip(self.headers, widths, strict=True)):
            justify: JustifyMethod = "right" if i in self.right else "left"
            table.add_column(header, width=width, overflow="fold", justify=justify)
        for row in self.rows:
            table.add_row(*row)
        yield table
