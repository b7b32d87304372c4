"""What a measurement reports besides its numbers: best-of timing, nearest-rank percentiles,
the machine and the run (``machine``, ``machine_line``: the provenance header of
``rigs.provenance`` and the load) and the ``--record`` section a benchmark appends to a markdown
file. Used by the benchmarks.

Standard library only at import (``pynvml`` is looked up when the machine is described): a
benchmark's ``--mode gpu`` runs on a GPU node with only its dependencies. Must not run the
measurement itself or judge its numbers.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from rigs.provenance import header, header_lines

T = TypeVar("T")


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100: the smallest value with at least ``q`` % of
    the values at or below it; p99 of 20 values is the maximum); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def best_of(call: Callable[[], T], *, repeat: int) -> tuple[float, T]:
    """The fastest of ``repeat`` calls (at least one), in ``perf_counter`` seconds, and the last
    call's result."""
    started = time.perf_counter()
    result = call()
    best = time.perf_counter() - started
    for _ in range(repeat - 1):
        started = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - started)
    return best, result


def machine() -> dict[str, str]:
    """The machine and the run, for a ``--record`` section: the provenance header (commit and
    whether its tree was dirty, the machine, the GPU driver, the command, the time), Python, the
    load average now (before the run: how busy the machine was), and the nvidia-ml-py version
    when it is installed."""
    info = header()
    info |= {
        "date": info["utc"].rsplit(":", 1)[0] + " UTC",
        "python": platform.python_version(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    try:
        import pynvml

        info["nvidia-ml-py"] = getattr(pynvml, "__version__", "?")
    except ImportError:
        pass
    return info


def machine_line() -> str:
    """The header of a printed table: the provenance header, then the 1-minute load."""
    return "\n".join([*header_lines(), f"# load {os.getloadavg()[0]:.2f}"])


def append_record(path: Path, heading: str, info: Mapping[str, str], body: str) -> None:
    """Append a ``### heading`` section (the machine as a list, then ``body``) to a markdown
    file: how ``--record docs/performance.md`` keeps a run."""
    meta = "\n".join(f"- {k}: `{v}`" for k, v in info.items())
    with path.open("a", encoding="utf-8") as f:
        f.write(f"\n### {heading}\n\n{meta}\n\n{body}\n")
