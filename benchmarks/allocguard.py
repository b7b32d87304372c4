"""What the eBPF allocation guard (gpuguard/adapters/allocguard/) costs a CUDA caller, on the
libcuda stand-in (tests/cuda_stub): the per-call overhead of its uprobes on an allocation and
its free, and how soon a caller that crosses its headroom is seen stopped.

Owns two measurements, each by a small C program compiled at run time with gcc (so Python's
own call overhead is not in the figures) that ``dlopen``s the stand-in:

- ``pairs``: N cuMemAlloc_v2 + cuMemFree_v2 pairs, each pair timed with CLOCK_MONOTONIC, in
  three conditions: no guard loaded; the guard attached but the caller's cgroup not guarded
  (the probes run and return at the headroom lookup); and guarded (a headroom far above
  anything allocated, the caller's context made current through the probes: the full path,
  count, pending entry, size entry, per-process total, free). The allocation (its entry's
  uprobe and its return's uretprobe) and the free (one uprobe) are timed apart: p50/p99/mean
  per call, and the p50 over the bare p50. What a uprobe costs depends on the instruction it
  replaces: x86 emulates a few (jmp, call, some push) in the trap itself and single-steps the
  rest out of line, a second trap (#DB), which a hypervisor may intercept; the script prints
  each probed symbol's first instruction for that reason.
- ``freeze``: headroom 0, so every allocation crosses; the program writes a CLOCK_MONOTONIC
  timestamp to its stdout just before cuMemAlloc_v2, and this script, its parent, wakes from
  ``waitpid(WUNTRACED)`` when the kernel reports it stopped. Latency = the wake-up time minus
  the timestamp: the uprobe trap, the BPF program, the SIGSTOP's delivery, and the parent's
  wake-up. SIGCONT, the call returns, it frees, and the next round starts.

Must not: signal anything but the program it started (by PID), or keep anything loaded: the
guard is closed and the cgroups removed at the end. Needs root, kernel BTF and uprobes.
Usage: ``python benchmarks/allocguard.py [--pairs N] [--freezes N]``; the raw output kept in
docs/results/ is its stdout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuguard.adapters.allocguard import AllocGuard, cgroup_id
from gpuguard.core.model import ContainerCgroup
from rigs.allocguard import build
from rigs.cgroups import CgroupTree, cgroup_dir
from rigs.provenance import header_lines

PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
typedef int (*retain_fn)(void **, int);
typedef int (*set_fn)(void *);

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* argv: library, mode (pairs | freeze), count. pairs: waits for a byte on stdin, then prints
 * one line a pair: the allocation's ns, the free's ns.
 * freeze: per round reads a byte from stdin, writes the 8-byte timestamp, allocates. */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) return 3;
    alloc_fn alloc = (alloc_fn)dlsym(lib, "cuMemAlloc_v2");
    free_fn release = (free_fn)dlsym(lib, "cuMemFree_v2");
    retain_fn retain = (retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
    set_fn set = (set_fn)dlsym(lib, "cuCtxSetCurrent");
    void *ctx = NULL;
    if (!alloc || !release || !retain || !set || retain(&ctx, 0) || set(ctx)) return 4;
    long n = atol(argv[3]);
    unsigned long long p;
    char go;
    if (strcmp(argv[2], "pairs") == 0) {
        if (read(0, &go, 1) != 1) return 6; /* started once it is in its cgroup */
        long long *ns = malloc(sizeof(long long) * 2 * n);
        for (long i = 0; i < 1000; i++) { alloc(&p, 4096); release(p); } /* warm */
        for (long i = 0; i < n; i++) {
            long long t0 = now_ns();
            if (alloc(&p, 4096)) return 5;
            long long t1 = now_ns();
            if (release(p)) return 5;
            ns[2 * i] = t1 - t0;
            ns[2 * i + 1] = now_ns() - t1;
        }
        for (long i = 0; i < n; i++) printf("%lld %lld\n", ns[2 * i], ns[2 * i + 1]);
        return 0;
    }
    for (long i = 0; i < n; i++) {
        if (read(0, &go, 1) != 1) return 6;
        long long t0 = now_ns();
        if (write(1, &t0, sizeof(t0)) != sizeof(t0)) return 7;
        if (alloc(&p, 4096) || release(p)) return 8;
    }
    return 0;
}
"""


def first_instruction(library: Path, symbol: str) -> str:
    """The instruction a uprobe on ``symbol`` replaces, as objdump prints it: x86 uprobes emulate
    a few (jmp, call, push) and single-step the rest out of line, one more trap."""
    try:
        done = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", str(library)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError as exc:
        return f"unknown ({exc.strerror})"
    lines = done.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.endswith(f"<{symbol}>:") and i + 1 < len(lines):
            return " ".join(lines[i + 1].split(":", 1)[-1].split())
    return "unknown (not in objdump's output)"


def compile_program(work: Path) -> Path:
    source, binary = work / "caller.c", work / "caller"
    source.write_text(PROGRAM)
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(source), "-ldl"], check=True)
    return binary


def pairs(tree: CgroupTree, cg: ContainerCgroup, argv: list[str]) -> tuple[list[int], list[int]]:
    """Each pair's allocation and free, in ns."""
    proc = tree.spawn(argv, cgroups=[cg], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out, _ = proc.communicate(input=b"g", timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} pairs exited {proc.returncode}")
    rows = [tuple(map(int, line.split())) for line in out.splitlines()]
    return [a for a, _ in rows], [f for _, f in rows]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def row(label: str, call: str, ns: list[int], base_p50: float) -> str:
    return (
        f"| {label} | {call} | {len(ns)} | {percentile(ns, 0.5) / 1000:.2f} | "
        f"{percentile(ns, 0.99) / 1000:.2f} | {statistics.fmean(ns) / 1000:.2f} | "
        f"{(percentile(ns, 0.5) - base_p50) / 1000:+.2f} |"
    )


def freezes(tree: CgroupTree, cg: ContainerCgroup, argv: list[str], rounds: int) -> list[int]:
    proc = tree.spawn(
        argv,
        cgroups=[cg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    latencies: list[int] = []
    for _ in range(rounds):
        proc.stdin.write(b"g")
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        seen = time.monotonic_ns()
        if not os.WIFSTOPPED(status):
            raise RuntimeError(f"the caller ended instead of stopping: status {status}")
        (t0,) = struct.unpack("q", proc.stdout.read(8))
        latencies.append(seen - t0)
        proc.send_signal(signal.SIGCONT)  # our own child
    proc.stdin.close()
    proc.wait(timeout=30)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=200_000, help="pairs per condition")
    parser.add_argument("--freezes", type=int, default=300, help="crossings timed")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (bpf, uprobes, cgroups)", file=sys.stderr)
        return 2
    built = build()
    for line in header_lines():
        print(line)
    print(f"# load {os.getloadavg()[0]:.2f}")
    print(
        "# stand-in: tests/cuda_stub (a mutex and a 4096-slot table per call); each pair is "
        "cuMemAlloc_v2(4096) + cuMemFree_v2, timed in C with CLOCK_MONOTONIC"
    )
    for symbol in ("cuMemAlloc_v2", "cuMemFree_v2"):
        print(f"# {symbol} starts with: {first_instruction(built.stub_library, symbol)}")
    with tempfile.TemporaryDirectory() as tmp:
        binary = compile_program(Path(tmp))
        lib = str(built.stub_library)
        tree = CgroupTree()
        try:
            guarded = tree.make(2, "guarded")
            plain = tree.make(2, "plain")
            argv = [str(binary), lib, "pairs", str(args.pairs)]
            bare = pairs(tree, plain, argv)
            guard = AllocGuard(object_path=built.object_path, library_path=built.stub_library)
            try:
                cid = cgroup_id(cgroup_dir(guarded))
                unguarded = pairs(tree, plain, argv)
                guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=1 << 50)
                full = pairs(tree, guarded, argv)
                guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=0)
                crossing = freezes(
                    tree, guarded, [str(binary), lib, "freeze", str(args.freezes)], args.freezes
                )
            finally:
                guard.close()
        finally:
            tree.close()
    print("\n## per call (µs): cuMemAlloc_v2(4096) (uprobe + uretprobe), cuMemFree_v2 (uprobe)")
    print("| condition | call | calls | p50 | p99 | mean | p50 over no guard |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, (allocs, frees) in (
        ("no guard", bare),
        ("guard attached, cgroup not guarded", unguarded),
        ("guarded (full path)", full),
    ):
        for call, ns, base in (("alloc", allocs, bare[0]), ("free", frees, bare[1])):
            print(row(label, call, ns, percentile(base, 0.5)))
    print("\n## crossing → seen stopped (µs): timestamp before the call → parent's waitpid")
    print("| rounds | p50 | p99 | max |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {len(crossing)} | {percentile(crossing, 0.5) / 1000:.1f} | "
        f"{percentile(crossing, 0.99) / 1000:.1f} | {max(crossing) / 1000:.1f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
