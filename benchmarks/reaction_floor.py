"""Reference rows of benchmarks/reaction.py's CPU tables: what the machine charges any watcher
before it does anything, and what the NVML stand-in charges gpuguard's calls.

Owns three kinds of process, each measured side by side with the watchers and exactly like one
(its CPU clock, all threads, plus waited-for children, over the same wall time):

- ``floor-python``: a bare Python loop, ``time.sleep(<fast interval>)`` forever: the wake-up
  floor gpuguard's idle CPU target is stated against (idle ≤ 2× this);
- ``floor-c``: a bare C loop, ``clock_nanosleep(CLOCK_MONOTONIC, 0, <fast interval>)`` forever,
  compiled at run time with gcc; without gcc (or when it fails) the row says so and has no
  numbers;
- ``stand-in-alone``: ``reaction_worker.py nvml-calls``, the NVML calls gpuguard's change-driven
  mode makes in steady state, through pynvml on the stand-in library, without gpuguard.

Must not: signal anything but its own processes (each is stopped by its PID), or write outside
the directory it is given. Every process starts in a session of its own (``Logged``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rigs.processes import Logged

WORKER = Path(__file__).resolve().parent / "reaction_worker.py"

C_FLOOR_SOURCE = r"""
#include <stdlib.h>
#include <time.h>

/* The wake-up floor: sleep argv[1] nanoseconds, forever, doing nothing else. */
int main(int argc, char **argv) {
    long long ns = argc > 1 ? atoll(argv[1]) : 50000000LL;
    struct timespec interval = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    for (;;)
        clock_nanosleep(CLOCK_MONOTONIC, 0, &interval, NULL);
}
"""


@dataclass(slots=True, kw_only=True)
class Reference:
    """A process measured beside the watchers for reference; never a watcher (it signals
    nothing, and the trials never run with it)."""

    key: str
    label: str
    process: Logged | None
    """``None``: it could not be started; ``note`` says why."""
    note: str = ""
    cpu_ms_per_s: dict[int, float] = field(default_factory=dict)
    """CPU phase: GPU processes → its CPU ms per wall second."""
    steady_ms_per_s: float | None = None
    """Stub steady phase: its CPU ms per wall second there."""

    @property
    def title(self) -> str:
        return self.label + (f" [{self.note}]" if self.note else "")

    def launch(self) -> None:
        if self.process is not None:
            self.process.launch()

    def alive(self) -> bool:
        return self.process is None or self.process.alive()

    def tail(self) -> str:
        return "" if self.process is None else self.process.tail()

    def cpu_seconds(self) -> float:
        assert self.process is not None
        return self.process.cpu_seconds()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def python_floor(interval: float, env: dict[str, str], out: Path) -> Reference:
    label = f"floor: bare Python loop (time.sleep({interval:g}))"
    code = f"import time\nwhile True:\n    time.sleep({interval!r})\n"
    argv = [sys.executable, "-c", code]
    log = out / "floor-python.log"
    return Reference(key="floor-python", label=label, process=_logged(label, argv, env, log))


def c_floor(interval: float, env: dict[str, str], out: Path) -> Reference:
    """The C loop, built into ``out / "tmp"``; without gcc, or when the build fails, a
    reference with no process and a note that says why."""
    label = "floor: bare C loop (clock_nanosleep)"
    gcc = shutil.which("gcc")
    if gcc is None:
        return Reference(key="floor-c", label=label, process=None, note="not measured: no gcc")
    tmp = out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    source, binary = tmp / "floor.c", tmp / "floor"
    source.write_text(C_FLOOR_SOURCE)
    done = subprocess.run(
        [gcc, "-O2", "-o", str(binary), str(source)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        note = f"not measured: gcc failed: {why[0]}"
        return Reference(key="floor-c", label=label, process=None, note=note)
    argv = [str(binary), str(round(interval * 1e9))]
    log = out / "floor-c.log"
    return Reference(key="floor-c", label=label, process=_logged(label, argv, env, log))


def stand_in_alone(
    *, fast_interval: float, poll: float, gpus: int, procs: int, env: dict[str, str], out: Path
) -> Reference:
    """The stand-in's own cost at ``gpus`` × ``procs`` (the process reads the GPU count from
    the library itself)."""
    label = (
        "stand-in alone (the NVML calls gpuguard makes, no gpuguard): "
        f"{gpus} GPUs × {procs} processes, per {fast_interval * 1000:g} ms a count + "
        f"{gpus} memory reads, per {poll:g} s a listing"
    )
    argv = [sys.executable, str(WORKER), "nvml-calls", "--fast-interval", str(fast_interval),
            "--poll", str(poll)]  # fmt: skip
    log = out / "stand-in-alone.log"
    return Reference(key="stand-in-alone", label=label, process=_logged(label, argv, env, log))


def _logged(name: str, argv: list[str], env: dict[str, str], log: Path) -> Logged:
    log.unlink(missing_ok=True)  # an --out reused: only this run's output
    return Logged(name=name, argv=argv, env=env, log=log)
