"""The allocation guard on a real GPU: the eBPF uprobes on the driver's own ``libcuda.so.1``,
real CUDA processes in cgroups of their own, NVML reading what they hold.

Two modes:

- ``pack DIR`` (here, where ``scripts/ensure-bpf.sh`` works): the compiled BPF object, libbpf's
  headers, ``libbpf.so.1`` and the ``libelf.so.1`` it links, into ``DIR`` (about 1 MiB), which
  the GPU machine's run carries: that machine has a compiler and Python's headers but no libbpf.
- ``run --bpf DIR --out OUT`` (on the GPU machine, as root): builds the loader extension and
  ``scripts/gpu_cuda_probe.c`` there, then records, each step's facts as JSON in
  ``OUT/result.json`` and a table on stdout:

  1. the machine: kernel, BTF, the driver's libcuda file (as a CUDA process maps it);
  2. ``addrs``: whether the exported entry points the guard probes are the functions
     ``cuGetProcAddress`` hands the CUDA runtime (PyTorch's allocator calls those);
  3. attach: the guard on that file, or the reason it cannot attach;
  4. overhead: ``cuMemAlloc_v2`` + ``cuMemFree_v2`` pairs without the guard, with it attached
     but the caller's cgroup not guarded, and guarded (headroom never reached): ns per pair;
  5. freeze: a C process (``gpu_cuda_probe hold``) allocating 1 GiB steps past its headroom
     is stopped at the call (``T`` in ``/proc/<pid>/stat``), NVML never shows the crossing
     step's memory, and a neighbour in another cgroup allocates the same steps meanwhile;
  6. the same with a PyTorch process (``scripts/gpu_e2e_worker.py --role greedy``): whether the
     runtime's allocation path reaches the probed functions at all.

Must not: signal a process it did not start (each is ended by pidfd through
``rigs.e2e_node.Cgroups.close``), change the GPU's settings, or leave a cgroup, a probe or a
process behind.

Usage::

    python -m scripts.gpu_allocguard pack .bpfrt                         # here
    python3 -m scripts.gpu_allocguard run --bpf .bpfrt --out $OUT/ag     # on the GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rigs.e2e_node import MIB, Cgroups, spawn_in, v2_mount
from rigs.provenance import header, header_lines

REPO = Path(__file__).resolve().parents[1]
GUARD_SOURCE = REPO / "gpuguard" / "adapters" / "allocguard"
PROBE_SOURCE = REPO / "scripts" / "gpu_cuda_probe.c"
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# pack (here)


def pack(out: Path) -> None:
    from rigs.allocguard import bpf_tools, build

    built = build()
    tools = bpf_tools()
    if tools is None:
        raise SystemExit("scripts/ensure-bpf.sh failed: nothing to pack")
    if out.exists():
        shutil.rmtree(out)
    (out / "lib").mkdir(parents=True)
    shutil.copy2(built.object_path, out / "guard.bpf.o")
    shutil.copytree(tools / "include" / "bpf", out / "include" / "bpf")
    shutil.copy2((tools / "lib" / "libbpf.so.1").resolve(), out / "lib" / "libbpf.so.1")
    libelf = Path("/lib/x86_64-linux-gnu/libelf.so.1")
    shutil.copy2(libelf.resolve(), out / "lib" / "libelf.so.1")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"packed {out}: {size / MIB:.1f} MiB")


# ---------------------------------------------------------------------------------------------
# run (on the GPU machine)


def build_there(bpf: Path, work: Path) -> tuple[str, Path]:
    """The loader extension (against the carried libbpf), unless one imports already (a
    checkout where the tests built it), and the probe program."""
    from gpuguard.adapters.allocguard import loader_built

    loader = "already built"
    if not loader_built():
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        ext = GUARD_SOURCE / f"_loader{suffix}"
        lib = (bpf / "lib").resolve()
        subprocess.run(
            [
                "cc",
                "-O2",
                "-std=gnu11",
                "-fPIC",
                "-shared",
                f"-I{sysconfig.get_paths()['include']}",
                f"-I{bpf / 'include'}",
                "-o",
                str(ext),
                str(GUARD_SOURCE / "_loader.c"),
                f"-L{lib}",
                # DT_RPATH, not RUNPATH: libbpf's own libelf is found there too.
                f"-Wl,--disable-new-dtags,-rpath,{lib}",
                "-l:libbpf.so.1",
            ],
            check=True,
        )
        loader = str(ext)
    probe = work / "gpu_cuda_probe"
    subprocess.run(["cc", "-O2", "-o", str(probe), str(PROBE_SOURCE), "-ldl"], check=True)
    return loader, probe


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(line)
            if isinstance(value, dict):
                out.append(value)
    return out


def state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def mapped_libcuda(pid: int) -> Path | None:
    """The libcuda file a CUDA process mapped (its path in this mount namespace)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "/libcuda.so" in fields[5]:
                return Path(fields[5].strip())
    return None


class Nvml:
    def __init__(self) -> None:
        import pynvml

        self._n = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used(self, pid: int) -> int:
        for p in self._n.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid == pid:
                return int(p.usedGpuMemory or 0)
        return 0

    def facts(self) -> dict[str, Any]:
        n = self._n
        return {
            "gpu": n.nvmlDeviceGetName(self.handle),
            "driver": n.nvmlSystemGetDriverVersion(),
            "memory_total_bytes": int(n.nvmlDeviceGetMemoryInfo(self.handle).total),
        }


class Worker:
    """One process started inside a cgroup of its own, its stdout read line by line (stderr to
    ``<name>.stderr`` in the output directory)."""

    def __init__(self, cgroups: Cgroups, name: str, argv: Sequence[str], logs: Path) -> None:
        self.dir, _ = cgroups.make(name)
        self.stderr = logs / f"{name}.stderr"
        with self.stderr.open("w") as err:
            self.proc = spawn_in(
                self.dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
            )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buffered = b""
        self.lines: list[dict[str, Any]] = []
        self.text: list[str] = []

    def _take(self) -> bool:
        try:
            chunk = os.read(self._fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return False
        self._buffered += chunk
        *done, self._buffered = self._buffered.split(b"\n")
        for raw in done:
            line = raw.decode(errors="replace")
            self.lines.extend(json_lines(line))
            self.text.append(line)
        return True

    def read_until(self, key: str, timeout: float) -> dict[str, Any] | None:
        """The first JSON line with ``key``, or ``{"line": …}`` for a plain line starting with
        it (the PyTorch worker prints ``ready <pid>``); None at the timeout or the end."""
        deadline = time.monotonic() + timeout
        while True:
            got = self._take()
            for parsed in self.lines:
                if key in parsed:
                    return parsed
            for raw in self.text:
                if raw.startswith(key):
                    return {"line": raw}
            if time.monotonic() >= deadline or (not got and self.proc.poll() is not None):
                return None
            if not got:
                time.sleep(0.005)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def run_probe(probe: Path, *args: str, cgroup: Path | None = None) -> list[dict[str, Any]]:
    argv = [str(probe), *args]
    if cgroup is not None:
        proc = spawn_in(cgroup, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=300)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        out, err = done.stdout, done.stderr
    lines = json_lines(out)
    if err.strip():
        lines.append({"stderr": err.strip()[-2000:]})
    return lines


def overhead(
    probe: Path, cgroups: Cgroups, guard: Any, cgroup_id: Any, pairs: int
) -> dict[str, Any]:
    """ns per cuMemAlloc_v2 + cuMemFree_v2 pair: no guard, attached but unguarded, guarded."""
    out: dict[str, Any] = {}
    bench_dir, _ = cgroups.make("bench")
    cg = cgroup_id(bench_dir)
    args = ("bench", str(pairs), str(MIB))
    out["attached_unguarded"] = run_probe(probe, *args, cgroup=bench_dir)
    guard.set_headroom(cgroup_id=cg, device=0, headroom_bytes=1 << 50)
    guard.reset(cgroup_id=cg, device=0)
    out["guarded"] = run_probe(probe, *args, cgroup=bench_dir)
    guard.clear_headroom(cgroup_id=cg, device=0)
    return out


def freeze_trial(
    *,
    cgroups: Cgroups,
    nvml: Nvml,
    guard: Any,
    cgroup_id: Any,
    name: str,
    greedy_argv: Sequence[str],
    neighbour_argv: Sequence[str] | None,
    headroom_bytes: int,
    ready_key: str,
    watch_s: float,
    logs: Path,
) -> dict[str, Any]:
    """The greedy worker guarded with ``headroom_bytes`` above its usage at "ready": is it
    stopped at the crossing call, does NVML ever show the crossing, does the neighbour's
    allocation of the same size succeed meanwhile."""
    facts: dict[str, Any] = {"name": name, "headroom_bytes": headroom_bytes}
    greedy = Worker(cgroups, f"{name}-greedy", greedy_argv, logs)
    ready = greedy.read_until(ready_key, timeout=180)
    if ready is None:
        facts["error"] = f"{name}: the greedy worker never got ready"
        facts["stderr"] = greedy.stderr.read_text(errors="replace")[-2000:]
        return facts
    pid = greedy.proc.pid
    facts["library"] = str(mapped_libcuda(pid))
    base = nvml.used(pid)
    cg = cgroup_id(greedy.dir)
    guard.set_headroom(cgroup_id=cg, device=0, headroom_bytes=headroom_bytes)
    guard.reset(cgroup_id=cg, device=0)
    facts["usage_at_ready_bytes"] = base
    started = time.monotonic_ns()
    greedy.go()
    stopped_at: int | None = None
    peak = base
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        peak = max(peak, nvml.used(pid))
        if state(pid) == "T":
            stopped_at = time.monotonic_ns()
            # Decided "over", as the enforcer would: the bound's thawer must leave it stopped.
            forget = getattr(guard, "forget", None)
            if forget is not None:
                forget(tgid=pid)
            break
        if greedy.proc.poll() is not None:
            break
        time.sleep(0.0005)
    facts["stopped"] = stopped_at is not None
    events = guard.poll(timeout_ms=200)
    facts["events"] = [
        {k: (v.name if hasattr(v, "name") else v) for k, v in vars_of(e).items()} for e in events
    ]
    if stopped_at is not None:
        greedy.read_until("__never__", timeout=0.2)
        befores = [line["before_ns"] for line in greedy.lines if "before_ns" in line]
        facts["stopped_after_go_ms"] = (stopped_at - started) / 1e6
        if befores:
            facts["last_call_to_stop_seen_ms"] = (stopped_at - befores[-1]) / 1e6
        time.sleep(1.0)  # NVML would show a crossing allocation that had run by now
        peak = max(peak, nvml.used(pid))
        facts["state_after_1s"] = state(pid)
        if neighbour_argv is not None:
            neighbour = Worker(cgroups, f"{name}-neighbour", neighbour_argv, logs)
            n_ready = neighbour.read_until(ready_key, timeout=180)
            if n_ready is not None:
                neighbour.go()
                done = neighbour.read_until("holding", timeout=120)
                if done is None:
                    done = neighbour.read_until("held_mib", timeout=1)
                facts["neighbour_allocated"] = done is not None
                facts["neighbour_usage_bytes"] = nvml.used(neighbour.proc.pid)
            else:
                facts["neighbour_allocated"] = False
    facts["peak_usage_bytes"] = peak
    facts["crossed_by_bytes"] = peak - base - headroom_bytes
    guard.clear_headroom(cgroup_id=cg, device=0)
    return facts


def vars_of(event: Any) -> dict[str, Any]:
    return {name: getattr(event, name) for name in event.__slots__}


@contextlib.contextmanager
def cgroup_root() -> Iterator[Cgroups]:
    cgroups = Cgroups(v2_mount(), f"gpuguard-allocguard-{os.getpid()}")
    try:
        yield cgroups
    finally:
        problems = cgroups.close()
        if problems:
            print(f"cleanup problems: {problems}", file=sys.stderr)


def run(bpf: Path, out: Path, pairs: int, *, torch: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print("\n".join(header_lines()), flush=True)
    result: dict[str, Any] = {"provenance": header()}
    btf = Path("/sys/kernel/btf/vmlinux")
    result["machine"] = {
        "kernel": platform.release(),
        "btf": btf.is_file(),
        "python": platform.python_version(),
    }
    nvml = Nvml()
    result["machine"].update(nvml.facts())
    loader, probe = build_there(bpf, out)
    result["built"] = {"loader": loader, "probe": str(probe)}
    result["addrs"] = run_probe(probe, "addrs")
    from gpuguard.adapters.allocguard import AllocGuard, cgroup_id

    torch_python = shutil.which("python3") or sys.executable
    with cgroup_root() as cgroups:
        # The driver's file, as a CUDA process maps it.
        finder = Worker(cgroups, "finder", [str(probe), "hold", "1", "0"], out)
        finder.read_until("ready", timeout=120)
        library = mapped_libcuda(finder.proc.pid)
        result["library"] = str(library)
        result["baseline"] = run_probe(probe, "bench", str(pairs), str(MIB))
        try:
            if library is None:
                raise OSError("no libcuda mapped by the finder process")
            guard = AllocGuard(object_path=bpf / "guard.bpf.o", library_path=library)
        except OSError as e:
            result["attach"] = f"cannot attach: {e}"
            guard = None
        else:
            result["attach"] = "attached"
        if guard is not None:
            try:
                result["overhead"] = overhead(probe, cgroups, guard, cgroup_id, pairs)
                result["freeze_c"] = freeze_trial(
                    cgroups=cgroups,
                    nvml=nvml,
                    guard=guard,
                    cgroup_id=cgroup_id,
                    name="c",
                    greedy_argv=[str(probe), "hold", "1024", "8"],
                    neighbour_argv=[str(probe), "hold", "1024", "4"],
                    headroom_bytes=3 * GIB + GIB // 2,
                    ready_key="ready",
                    watch_s=30,
                    logs=out,
                )
                worker = [
                    torch_python,
                    str(REPO / "scripts" / "gpu_e2e_worker.py"),
                    "--role",
                    "greedy",
                    "--step-mib",
                    "1024",
                    "--interval",
                    "0.2",
                    "--max-mib",
                    "8192",
                    "--record",
                    str(out / "torch-records.jsonl"),
                ]
                if not torch:
                    result["freeze_torch"] = "not run (--no-torch)"
                    return finish(out, result)
                result["freeze_torch"] = freeze_trial(
                    cgroups=cgroups,
                    nvml=nvml,
                    guard=guard,
                    cgroup_id=cgroup_id,
                    name="torch",
                    greedy_argv=worker,
                    neighbour_argv=None,
                    headroom_bytes=3 * GIB + GIB // 2,
                    ready_key="ready",
                    watch_s=30,
                    logs=out,
                )
            finally:
                guard.close()
    return finish(out, result)


def finish(out: Path, result: dict[str, Any]) -> int:
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.gpu_allocguard",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("pack", help="pack the BPF object and libbpf for the GPU machine")
    p.add_argument("dir", type=Path)
    r = sub.add_parser("run", help="on the GPU machine, as root")
    r.add_argument("--bpf", type=Path, required=True, help="what `pack` made")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--pairs", type=int, default=20000, help="alloc+free pairs per overhead run")
    r.add_argument("--no-torch", action="store_true", help="skip the PyTorch trial (no torch)")
    args = parser.parse_args(argv)
    if args.mode == "pack":
        pack(args.dir)
        return 0
    return run(args.bpf, args.out, args.pairs, torch=not args.no_torch)


if __name__ == "__main__":
    raise SystemExit(main())
