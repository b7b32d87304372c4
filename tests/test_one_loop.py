"""There is one enforcement loop: what `gpuguard enforce` runs is what the demo, the benchmarks
and the tests turn.

``Enforcer`` reads the GPUs only through its ``ChangeDrivenSampler`` (poll-only is that sampler at
a fixed tick) and offers two ways to turn its loop, ``run`` (its reader thread, until stopped) and
``step`` (one turn, paced by the caller), which take the same read, hand-over and cycle. A second
loop (a public cycle beside them, a GPU source read without the sampler, a caller that drives
something else) fails here.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

from gpuguard.runtime.enforcer import Enforcer
from tests.enforcer_world import G0, World
from tests.fakes import GiB, proc

ROOT = Path(__file__).resolve().parent.parent


def test_the_enforcer_offers_run_and_step_and_nothing_else_to_turn() -> None:
    public = {name for name, _ in inspect.getmembers(Enforcer) if not name.startswith("_")}
    assert public == {"run", "step"}


def test_the_enforcer_reads_the_gpus_only_through_its_sampler() -> None:
    parameters = inspect.signature(Enforcer).parameters
    assert parameters["sampler"].default is inspect.Parameter.empty, "a sampler is required"
    assert "gpu" not in parameters, "a GPU source read beside the sampler is a second loop"
    # Nothing in the loop calls a GPU source's listing itself: the sampler lists.
    tree = ast.parse((ROOT / "gpuguard/runtime/enforcer.py").read_text(encoding="utf-8"))
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert called.isdisjoint({"sample", "sample_devices", "read_memory"}), called


def test_run_and_step_turn_the_same_read_and_cycle() -> None:
    """Both end in one method that takes the hand-over and cycles (``_turn``), and both read
    through one (``_read``): the reader thread repeats it, ``step`` calls it once."""
    source = inspect.getsource(Enforcer)
    tree = ast.parse(inspect.cleandoc("\n" + source))
    [cls] = tree.body
    assert isinstance(cls, ast.ClassDef)
    methods = {f.name: f for f in cls.body if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef)}

    def names(method: str) -> set[str]:
        return {node.attr for node in ast.walk(methods[method]) if isinstance(node, ast.Attribute)}

    assert {"_turn", "_start_reads"} <= names("run")
    assert "_read" in names("_start_reads")
    assert {"_turn", "_read"} <= names("step")
    assert "_cycle_on" in names("_turn")
    cycles = [m for m in methods if m not in {"_turn"} and "_cycle_on" in names(m)]
    assert cycles == [], f"a cycle outside the loop's turn: {cycles}"


def test_what_the_demo_benchmarks_and_tests_drive_is_run_or_step() -> None:
    """No caller anywhere turns an enforcer another way (a ``cycle()`` of its own)."""
    offenders = []
    for folder in ("gpuguard", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in {"cycle", "_cycle_on", "_turn"}
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [o for o in offenders if not o.startswith("gpuguard/runtime/enforcer.py")] == []


def test_stepping_and_running_the_loop_stop_the_same_offender() -> None:
    """The same world, turned by ``step`` on a fake clock and by ``run`` on its own: both stop
    the pod over its limit, and only it, with the same signal."""

    async def stepped() -> list[tuple[str, str]]:
        w = World()
        w.gpu.processes = [proc(101, G0, 12 * GiB), proc(201, G0, 4 * GiB)]
        await w.run(5)  # 2.5 s: past the 1 s grace, before the SIGKILL at 3 s
        return [(t.pod.name, s.value) for t, s in w.killer.calls]

    async def ran() -> list[tuple[str, str]]:
        w = World()
        w.gpu.processes = [proc(101, G0, 12 * GiB), proc(201, G0, 4 * GiB)]
        stop = asyncio.Event()
        task = asyncio.create_task(w.enforcer.run(stop))
        for _ in range(80):  # 4 s on the enforcer's clock: past the 1 s grace
            if w.killer.calls:
                break
            w.clock.advance(0.05)
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        return [(t.pod.name, s.value) for t, s in w.killer.calls]

    assert asyncio.run(stepped()) == [("pod-1", "SIGTERM")]
    assert asyncio.run(ran()) == [("pod-1", "SIGTERM")]
