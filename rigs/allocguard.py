"""Builds the eBPF allocation guard for the kernel tests: the BPF object and the loader extension,
with the tools scripts/ensure-bpf.sh fetched, and the libcuda stand-in (tests/cuda_stub).

Owns: ``build()``; the object goes where the enforcer loads it from,
``allocguard.GUARD_OBJECT`` beside its source (the vmlinux.h bpftool writes from this kernel's
BTF in ``build/allocguard/``), the extension in place beside its source too (as
``make nvml-stub`` builds the NVML stand-in; setup.py builds it the same way when ``BPF_TOOLS``
is set, but reinstalling the package is not the tests' business). Must not: install anything
system-wide or load anything into the kernel (the tests do, through the loader).
"""

from __future__ import annotations

import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from gpuguard.adapters.allocguard import GUARD_OBJECT
from rigs.prereq import require

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "gpuguard" / "adapters" / "allocguard"
OUT = REPO / "build" / "allocguard"
STUB = REPO / "tests" / "cuda_stub" / "build" / "libcuda.so.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocGuardBuild:
    object_path: Path
    stub_library: Path


def bpf_tools() -> Path | None:
    """scripts/ensure-bpf.sh's directory (fetched once, cached), or None when it failed."""
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "ensure-bpf.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("BPF_TOOLS=")]
    if run.returncode != 0 or not lines:
        return None
    return Path(lines[-1].removeprefix("BPF_TOOLS="))


def build() -> AllocGuardBuild:
    """Everything the guard's tests need; ``require`` skips (fails in CI) when a tool is missing."""
    require(Path("/sys/kernel/btf/vmlinux").is_file(), "no kernel BTF (/sys/kernel/btf/vmlinux)")
    tools = bpf_tools()
    require(tools is not None, "scripts/ensure-bpf.sh failed (clang, bpftool, libbpf)")
    assert tools is not None
    subprocess.run(["make", "-s", "-C", str(STUB.parent.parent)], check=True)
    OUT.mkdir(parents=True, exist_ok=True)
    vmlinux = OUT / "vmlinux.h"
    with vmlinux.open("wb") as out:
        subprocess.run(
            [
                str(tools / "bin" / "bpftool"),
                "btf",
                "dump",
                "file",
                "/sys/kernel/btf/vmlinux",
                "format",
                "c",
            ],
            stdout=out,
            check=True,
        )
    obj = GUARD_OBJECT
    tmp_obj = obj.with_name(obj.name + ".tmp")
    subprocess.run(
        [
            str(tools / "bin" / "clang"),
            "-g",
            "-O2",
            "-target",
            "bpf",
            "-mcpu=v3",
            "-D__TARGET_ARCH_x86",
            f"-I{OUT}",
            f"-I{tools / 'include'}",
            "-c",
            str(SOURCE / "guard.bpf.c"),
            "-o",
            str(tmp_obj),
        ],
        check=True,
    )
    tmp_obj.replace(obj)  # a guard loading it meanwhile reads a whole file
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    ext = SOURCE / f"_loader{suffix}"
    tmp = ext.with_name(ext.name + ".tmp")
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fPIC",
            "-shared",
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{tools / 'include'}",
            "-o",
            str(tmp),
            str(SOURCE / "_loader.c"),
            f"-L{tools / 'lib'}",
            f"-Wl,-rpath,{tools / 'lib'}",
            "-lbpf",
        ],
        check=True,
    )
    tmp.replace(ext)  # renamed into place: a process with the old one mapped keeps its pages
    return AllocGuardBuild(object_path=obj, stub_library=STUB)
