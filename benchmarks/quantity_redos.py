"""What a hostile limit annotation costs to parse: gpuguard's reader against the alternatives.

Owns measurement only. A tenant controls ``gpuguard.io/gpu-memory-limit`` and the API server
accepts up to 256 KiB of annotations; the enforcer parses the value on every watch event and
relist, in the thread that also feeds polls and ``/healthz``. Rows, for values
``"1" * n + "x"`` (the worst case of the API server's quantity pattern):

- ``gpuguard parse_limit_annotation``: the shipped reader (length bound, possessive pattern);
- ``backtracking pattern``: the API server's pattern run by Python's ``re`` as gpuguard did
  before the fix (quadratic: measured up to 48 k characters, extrapolated beyond);
- ``kubernetes.utils.parse_quantity``: the Python client's parser, what a naive agent calls.

    .venv/bin/python -m benchmarks.quantity_redos
    .venv/bin/python -m benchmarks.quantity_redos --record docs/performance.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import re
from functools import partial
from pathlib import Path

from kubernetes.utils import parse_quantity

from gpuguard.core.model import LIMIT_ANNOTATION
from gpuguard.kubemodel.quantity import parse_limit_annotation
from rigs.measure import best_of
from rigs.provenance import header_lines

BACKTRACKING = re.compile(r"[+-]?[0-9.]+([eEinumkKMGTP]*[-+]?[0-9]*)", re.ASCII)
SIZES = (1 << 10, 16 << 10, 48 << 10, 256 << 10)
MEASURED_LIMIT = 48 << 10
"""Above this the backtracking pattern is extrapolated (n² from the largest measured size)."""


def _client(text: str) -> None:
    with contextlib.suppress(ValueError):
        parse_quantity(text)


def measure() -> list[tuple[str, int, float, bool]]:
    rows: list[tuple[str, int, float, bool]] = []
    largest: tuple[int, float] | None = None
    for n in SIZES:
        text = "1" * n + "x"
        annotations = {LIMIT_ANNOTATION: text}
        rows.append(
            (
                "gpuguard parse_limit_annotation",
                n,
                best_of(partial(parse_limit_annotation, annotations), repeat=200)[0],
                False,
            )
        )
        if n <= MEASURED_LIMIT:
            spent = best_of(partial(BACKTRACKING.fullmatch, text), repeat=1)[0]
            largest = (n, spent)
            rows.append(("backtracking pattern (before the fix)", n, spent, False))
        else:
            assert largest is not None
            rows.append(
                (
                    "backtracking pattern (before the fix)",
                    n,
                    largest[1] * (n / largest[0]) ** 2,
                    True,
                )
            )
        rows.append(
            (
                "kubernetes.utils.parse_quantity",
                n,
                best_of(partial(_client, text), repeat=20)[0],
                False,
            )
        )
    return rows


def render(rows: list[tuple[str, int, float, bool]]) -> str:
    lines = [
        "| parser | value length | time per parse | |",
        "|---|---:|---:|---|",
    ]
    for name, n, seconds, extrapolated in rows:
        shown = f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds:.3f} s"
        how = "extrapolated (n²)" if extrapolated else "measured"
        lines.append(f"| {name} | {n // 1024} KiB | {shown} | {how} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    print("\n".join(header_lines()))
    table = render(measure())
    print(table)
    if args.record:
        stamp = datetime.date.today().isoformat()
        header = (
            f"\n### Parsing a hostile limit annotation ({stamp}, {platform.node()}, "
            f"{platform.python_implementation()} {platform.python_version()})\n\n"
            "`.venv/bin/python -m benchmarks.quantity_redos`\n\n"
        )
        with args.record.open("a", encoding="utf-8") as out:
            out.write(header + table + "\n")


if __name__ == "__main__":
    main()
