"""Figures that check themselves: the Markdown tables of a doc, the prose reference that ties a
measured figure to the line (or JSON key) of its kept raw output, the check that compares the
two value by value, and the detector that finds a measured-looking figure with no reference.

A prose figure is a Markdown link to its raw output, anchored at a line or a JSON key::

    [0.967 ms](results/reaction-gpu-2026-12-06-h100-bb27925.txt#L42)
    [2.83 ms/s](docs/results/x.json#key=rows.0.cpu_ms_per_s)
    [99 ms](../e2e-runs/x/results.json#key=summary.p99_s "ms from s")

The path is relative to the doc, as any Markdown link. The link text holds one number: it must
equal a number on that line (or the key's value) rounded to the precision the text prints it at
(``0.967`` takes 0.9665 up to 0.9675; ``99`` takes 98.5 up to 99.5). Units are never guessed:
the raw number is read in the text's unit, unless the link's title says ``"<unit> from
<unit>"`` (``"ms from s"``: the raw value is in seconds, the text in milliseconds), from
``SCALES``.

A figure that is not measured (a setting, a bound, a target) or whose raw output was lost is
marked, on its line, with ``<!-- not measured: why -->`` or ``<!-- not kept: what, when -->``
(a lost figure's line must say "not kept" in words too, for the reader); the same comment alone
on the first line under a heading marks that whole section.

Must not: read anything outside the checkout it is given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# Tables

NUMBER = re.compile(
    r"[*_`~≈<>≤≥]*[−+-]?\d[\d,]*(?:\.\d+)?"
    r"(?: ?(?:ms|s|µs|%|MiB|GiB|KiB|MB|GB|×|ms/s|CPU-s))?"
    r"(?: ?[/–-] ?[−+-]?\d[\d,]*(?:\.\d+)?(?: ?(?:ms|s|µs|%|MiB|GiB))?)?[*_`]*"
)
"""A measured cell: a number, maybe with a unit, or a pair (``1020 / 1054``, ``1.4–1.9``).
A table with one such cell is a measurement table; names, quantities (``8Gi``), flags and
prose are not numbers here."""

FIGURES = re.compile(r"^<!-- figures: (.+?) -->$")
"""The marker on the line right above a measurement table: the raw output its figures were
copied from (one or more paths, separated by spaces). Every row's first cell must be printed in
one of them: row names are what the script prints. A table whose header the raw output prints
as it is was copied whole: each of its rows must then be a row of that printed table, every
value as printed (a row name such as ``8`` says nothing on its own)."""


@dataclass(frozen=True)
class Table:
    heading: str
    section: str
    """The text from the table's heading down to the table."""
    marker: str | None
    rows: list[list[str]]
    header: list[str] = field(default_factory=list)
    lines: range = range(0)
    """The table's line numbers (1-based), header to last row."""


def markdown_tables(text: str) -> list[Table]:
    """Each table of a Markdown text (indented ones in list items too) with the nearest heading
    above it and the marker comment on the line right above it (blank lines skipped). Fenced
    code is not Markdown."""
    lines = text.splitlines()
    tables, heading, start, fenced = [], "", 0, False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            heading, start = line.lstrip("#").strip(), index
        elif (
            not fenced
            and line.lstrip().startswith("|")
            and index + 1 < len(lines)
            and re.fullmatch(r"\|[ :|-]+\|", lines[index + 1].strip())
        ):
            end = index + 2
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            above = next((x for x in reversed(lines[start:index]) if x.strip()), "")
            found = FIGURES.match(above.strip())
            rows = [
                [cell.strip() for cell in row.strip().strip("|").split("|")]
                for row in lines[index + 2 : end]
            ]
            section = "\n".join(lines[start:index])
            header = [cell.strip() for cell in line.strip().strip("|").split("|")]
            tables.append(
                Table(
                    heading,
                    section,
                    found.group(1) if found else None,
                    rows,
                    header,
                    range(index + 1, end + 1),
                )
            )
            index = end
            continue
        index += 1
    return tables


def is_measurement(table: Table) -> bool:
    return any(NUMBER.fullmatch(cell) for row in table.rows for cell in row)


# ---------------------------------------------------------------------------------------------
# References: a figure linked to its raw output

REFERENCE = re.compile(r"\[([^\]\n]+)\]\(([^)\s#]+)#(L\d+|key=[^)\s]+)(?: \"([^\"]*)\")?\)")
"""``[text](path#L<n>)`` or ``[text](path#key=a.b.0)``, with an optional ``"<unit> from
<unit>"`` title."""

FIGURE = re.compile(r"(?<![\w.,])[−+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|"
                    r"(?<![\w.,])[−+-]?\d+(?:\.\d+)?(?![\w.]\d)(?![\w])")  # fmt: skip
"""A number as a doc or a raw output prints it: a sign, thousands separated by commas, a
fraction. Digits inside a word (``p99``, ``H100``, ``v1``) are no number."""

RAW_FIGURE = re.compile(r"(?<![\w.,])[−+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d.,]\d)|"
                        r"(?<![\w.,])[−+-]?\d+(?:\.\d+)?(?![\d.,]\d|\d)")  # fmt: skip
"""A number as a raw output prints it: as ``FIGURE``, and a unit may follow with no space
(``rss=88.4MiB``, ``4.7ms``)."""

SCALES: dict[str, dict[str, float]] = {
    "time": {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0},
    "size": {"B": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30},
    "share": {"%": 0.01, "fraction": 1.0},
}
"""The units a title may convert between, by kind: a conversion within one kind only."""


@dataclass(frozen=True)
class Reference:
    line: int
    text: str
    path: str
    anchor: str
    title: str | None


def without_code(line: str) -> str:
    """``line`` with each code span blanked out: a link or a comment shown as code is text."""
    return re.sub(r"`[^`]*`", lambda span: " " * len(span.group(0)), line)


def references(text: str) -> Iterator[Reference]:
    """Each figure reference of a Markdown text, fenced code and code spans aside."""
    for number, line in prose_lines(text, skip_tables=False):
        for match in REFERENCE.finditer(without_code(line)):
            yield Reference(number, match.group(1), match.group(2), match.group(3), match.group(4))


def parse_number(text: str) -> float:
    return float(text.replace("−", "-").replace(",", ""))


def decimals(text: str) -> int:
    return len(text.split(".", 1)[1]) if "." in text else 0


def scale(title: str | None) -> float:
    """The factor from the raw output's unit to the text's (``"ms from s"``: 1000)."""
    if title is None:
        return 1.0
    match = re.fullmatch(r"(\S+) from (\S+)", title.strip())
    if match is None:
        raise ValueError(f'title {title!r} is not "<unit> from <unit>"')
    to, source = match.groups()
    for units in SCALES.values():
        if to in units and source in units:
            return units[source] / units[to]
    raise ValueError(f"no conversion from {source!r} to {to!r} in SCALES")


def raw_values(path: Path, anchor: str) -> tuple[list[float], str]:
    """The numbers at ``anchor`` of the raw output at ``path``, and the text they were read
    from (for the message)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if anchor.startswith("L"):
        lines = text.splitlines()
        index = int(anchor[1:])
        if not 1 <= index <= len(lines):
            raise ValueError(f"{path.name} has no line {index}")
        line = lines[index - 1]
        return [parse_number(m.group(0)) for m in RAW_FIGURE.finditer(line)], line.strip()
    value: Any = json.loads(text)
    for key in anchor.removeprefix("key=").split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise ValueError(f"{path.name} has no key {anchor}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{path.name} {anchor} is {value!r}, not a number")
    return [float(value)], f"{anchor} = {value}"


def reference_problem(doc: Path, ref: Reference) -> str | None:
    """What is wrong with one reference of ``doc``, or ``None``: its raw output is missing, its
    anchor is not there, or no number there is the text's figure at the text's precision."""
    where = f"{doc.name}:{ref.line} [{ref.text}]"
    figures = [m.group(0) for m in FIGURE.finditer(ref.text)]
    if len(figures) != 1:
        return f"{where}: a reference holds one figure, this holds {len(figures)}"
    path = (doc.parent / ref.path).resolve()
    if not path.is_file():
        return f"{where}: raw output {ref.path} missing"
    try:
        factor = scale(ref.title)
        found, shown = raw_values(path, ref.anchor)
    except ValueError as exc:
        return f"{where}: {exc}"
    figure = parse_number(figures[0])
    tolerance = 0.5 * 10.0 ** -decimals(figures[0]) * (1 + 1e-9)
    if not any(abs(value * factor - figure) <= tolerance for value in found):
        return f"{where}: {ref.path}#{ref.anchor} says {shown!r}"
    return None


def reference_problems(doc: Path, text: str) -> list[str]:
    return [p for ref in references(text) if (p := reference_problem(doc, ref)) is not None]


# ---------------------------------------------------------------------------------------------
# The detector: a measured-looking figure with no reference

UNIT = (
    r"(?:(?:[a-z]+ )?CPU-(?:seconds|second|s|ms)|ms/s|µs/s|wakeups/s|req/s|MiB/s|KiB/s"
    r"|ns|µs|us|ms|s|min|%|×|MiB|GiB|KiB|MB|GB|fds)"
)
MEASURED = re.compile(
    r"(?<![\w.,/])(?P<sign>[~≈]?[−+±-]?)(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?P<space> ?)(?P<unit>" + UNIT + r")(?![\w/])"
)
"""A number and its unit."""

ALWAYS_MEASURED = {"CPU-seconds", "CPU-second", "CPU-s", "CPU-ms", "µs", "us", "ns", "ms/s",
                   "µs/s", "wakeups/s", "MiB/s", "KiB/s", "fds"}  # fmt: skip
"""Units no setting is given in: a figure in one of them was measured, whole or not."""

CONTEXT = re.compile(
    r"\b(?:took|takes|taking|measured|lasted|median|mean|average|averaged|peak|worst|slowest"
    r"|fastest|p50|p90|p95|p99|max|cost|costs|grew|fell|rose|reacted)\b"
)
"""Words before a whole figure that make it a measurement (``p99 101 ms``, ``took 18 s``)."""

SETTING = re.compile(
    r"(?:[≤<≥>]=?|\b(?:bound|bounds|target|targets|limit|limits|every|grace|interval|timeout"
    r"|deadline|budget|default|defaults|poll|polls|sleep|sleeps|window|windows|at most"
    r"|at least|up to)"
    r")[ \t]*(?:of[ \t]+|is[ \t]+|=[ \t]*)?$"
)
"""Right before a figure: a comparison or a word that makes it a setting, a bound or a target
(``≤ 5 ms/s``, ``grace 0.25 s``, ``every 50 ms``, ``bound 10 %``)."""

SETTING_AFTER = re.compile(
    r"^[ \t]*(?:deadline|timeout|budget|grace|poll|polls|interval|limit|cap|cadence|bound"
    r"|target|window|sleep)\b"
)
"""Right after a figure: a word that makes it a setting (``a 1 s grace``, ``its 0.25 s
poll``, ``a 0.25 s deadline``)."""

WHOLE_SETTING = re.compile(r"\b(?:within|under|over|per|for|each)[ \t]*$")
"""Right before a whole figure: a word that makes it a bound or a span (``within 10 %``,
``per 20 s``, ``for 60 s``); a decimal after it is still measured (``within 2.3 %``)."""

RANGE_START = re.compile(r"(?<![\w.,])([~≈]?[−+-]?\d[\d,]*(?:\.\d+)?) ?(?:→|–|to|/) ?$")
"""The number before a measured figure's arrow, dash, slash or "to": a figure in the same unit
(``~9.7 → ~2.8 ms/s``, ``p50 / p99 77 / 99 ms``)."""

MARK = re.compile(r"<!-- (not measured|not kept|derived): (?=[^>]*[^\s>-])[^>]*-->")
"""An explicit, reviewed exemption on a line: a figure that is not a measurement (a setting, a
machine's size), one whose raw output was lost (the line says "not kept" in words too), or one
derived from referenced figures (the comment says how: ``<!-- derived: 1.235 ms / 100 PIDs
-->``)."""


def prose_lines(text: str, *, skip_tables: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) of each line outside fenced code; with ``skip_tables``, also
    outside measurement tables (the table check covers those)."""
    covered: set[int] = set()
    if skip_tables:
        for table in markdown_tables(text):
            if is_measurement(table) or table.marker is not None:
                covered.update(table.lines)
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and number not in covered:
            yield number, line


def _marked_sections(text: str) -> dict[int, str]:
    """Line number → the mark (``not measured``, ``not kept``, ``derived``) of the section it
    is in, for sections whose first non-blank line under the heading is a mark alone."""
    marked: dict[int, str] = {}
    current, expect, fenced = None, False, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            current, expect = None, True
            continue
        if expect and line.strip():
            mark = MARK.fullmatch(line.strip())
            current = mark.group(1) if mark else None
            expect = False
        if current is not None:
            marked[number] = current
    return marked


def _paragraph(lines: list[str], number: int) -> str:
    """The paragraph (lines between blank lines) that holds line ``number``."""
    start = number - 1
    while start > 0 and lines[start - 1].strip():
        start -= 1
    end = number
    while end < len(lines) and lines[end].strip():
        end += 1
    return " ".join(lines[start:end])


def is_measured(line: str, match: re.Match[str]) -> bool:
    """Whether the figure ``match`` of ``line`` looks measured: a decimal with a unit, any
    figure in a unit no setting uses, a whole number of milliseconds that is not a multiple of
    5, a ratio above 2×, a signed percentage, or a whole figure right after a measuring word;
    never one right after a comparison or a setting's word."""
    before = line[: match.start()]
    number, unit = match.group("number"), match.group("unit").split()[-1]
    if SETTING.search(before[-24:].lower()) or SETTING_AFTER.match(line[match.end() :].lower()):
        return False
    if "." not in number and WHOLE_SETTING.search(before[-24:].lower()):
        return False
    if unit == "×" and re.match(r"[ \t]*\d", line[match.end() :]):
        return False  # ``8 GPUs × 100``: a product of counts
    if "." in number or unit in ALWAYS_MEASURED:
        return True
    whole = int(number.replace(",", ""))
    if unit == "ms" and whole % 5:
        return True  # settings are round: ``250 ms``, ``50 ms``; ``99 ms`` was measured
    if unit == "×" and whole > 2:
        return True  # a ratio; ``2×`` is how targets and doublings are put
    if unit == "%" and match.group("sign").strip("~≈"):
        return True
    if unit in ("×", "%", "ms", "s", "min") and CONTEXT.search(before[-40:].lower()):
        return True
    return unit == "s" and bool(re.search(r"\d ?min $", before))  # ``18 min 40 s``


def unreferenced_figures(text: str) -> list[tuple[int, str]]:
    """(line number, figure) of each measured-looking figure of a doc's prose (and of its
    tables the table check does not cover) that carries neither a reference nor a mark."""
    sections = _marked_sections(text)
    found = []
    for number, line in prose_lines(text):
        bare = without_code(line)  # code: commands, settings, names
        if number in sections or MARK.search(bare):
            continue
        bare = REFERENCE.sub(" ", bare)
        bare = re.sub(r"<!--.*?-->|\]\([^)]*\)", " ", bare)  # comments, link targets
        for m in MEASURED.finditer(bare):
            if not is_measured(bare, m):
                continue
            start = RANGE_START.search(bare[: m.start()])
            if start is not None and start.group(1).strip():
                found.append((number, start.group(1).strip()))  # ``~9.7 → ~2.8 ms/s``
            found.append((number, m.group(0).strip()))
    return found


def mark_problems(text: str) -> list[str]:
    """Each ``not kept`` mark whose paragraph (or section) does not say "not kept" in words."""
    problems = []
    lines = [without_code(line) for line in text.splitlines()]
    for number, line in enumerate(lines, 1):
        mark = MARK.search(line)
        if mark is None or mark.group(1) != "not kept":
            continue
        visible = MARK.sub(" ", _paragraph(lines, number))
        if MARK.fullmatch(line.strip()):  # a section's mark: its next paragraph says it
            following = next((i for i in range(number, len(lines)) if lines[i].strip()), None)
            visible = "" if following is None else MARK.sub(" ", _paragraph(lines, following + 1))
        if "not kept" not in visible.lower():
            problems.append(f"line {number}: a 'not kept' mark whose text does not say so")
    return problems
