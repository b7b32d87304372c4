"""Builds gpuguard's native parts; everything else is in pyproject.toml.

- The fast path's quiet gate (gpuguard/adapters/nvml/_gate.c, docs/design.md, Fast path). Optional:
  where no C compiler is available (or on a platform without clock_nanosleep) the build goes on
  without it and gpuguard reads memory in Python, at a higher idle CPU cost; ``gpuguard enforce``
  logs which one runs (``fast_path_started``), and `make test` and `make image` fail when the
  gate is missing (tests/test_gate.py, scripts/build-image.sh).
- The eBPF allocation guard (gpuguard/adapters/allocguard/), only when ``BPF_TOOLS`` names
  scripts/ensure-bpf.sh's directory: the loader extension (``_loader``, linked to libbpf.so.1)
  and the BPF object ``guard.bpf.o``, compiled with that directory's clang against this
  machine's kernel types (bpftool from /sys/kernel/btf/vmlinux; CO-RE relocates it on the node's
  kernel) and written beside its source, where ``allocguard.GUARD_OBJECT`` finds it. Without
  ``BPF_TOOLS`` neither is built and ``enforcement.alloc_guard`` reports ``loader_not_built``.
  With it, a failure fails the build: an image built to carry the guard never ships without it.
"""

import os
import subprocess
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BPF_TOOLS = os.environ.get("BPF_TOOLS", "")
GUARD_SOURCE = Path("gpuguard/adapters/allocguard/guard.bpf.c")
BTF = Path("/sys/kernel/btf/vmlinux")


def compile_guard_object(tools: Path, out: Path) -> None:
    """``out`` = guard.bpf.c compiled for BPF (CO-RE) with the clang and bpftool of ``tools``
    (rigs/allocguard.py compiles it the same way for the kernel tests)."""
    if not BTF.is_file():
        raise RuntimeError(f"BPF_TOOLS is set but {BTF} is missing: no kernel types for CO-RE")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        vmlinux = Path(scratch) / "vmlinux.h"
        with vmlinux.open("wb") as header:
            dump = [str(tools / "bin" / "bpftool"), "btf", "dump", "file", str(BTF), "format", "c"]
            subprocess.run(dump, stdout=header, check=True)
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run(
            [str(tools / "bin" / "clang"), "-g", "-O2", "-target", "bpf", "-mcpu=v3",
             "-D__TARGET_ARCH_x86", f"-I{scratch}", f"-I{tools / 'include'}",
             "-c", str(GUARD_SOURCE), "-o", str(tmp)],
            check=True,
        )  # fmt: skip
        tmp.replace(out)


class BuildWithGuardObject(build_ext):
    """build_ext, plus the guard's BPF object beside the loader (in place or in the build
    directory the wheel is made from) when ``BPF_TOOLS`` is set."""

    def run(self) -> None:
        super().run()
        if not BPF_TOOLS:
            return
        package = GUARD_SOURCE.parent
        target = package if self.inplace else Path(self.build_lib) / package
        compile_guard_object(Path(BPF_TOOLS), target / "guard.bpf.o")


ALLOCGUARD = (
    [
        Extension(
            "gpuguard.adapters.allocguard._loader",
            sources=["gpuguard/adapters/allocguard/_loader.c"],
            include_dirs=[f"{BPF_TOOLS}/include"],
            library_dirs=[f"{BPF_TOOLS}/lib"],
            runtime_library_dirs=[f"{BPF_TOOLS}/lib"],
            libraries=["bpf"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror"],
            optional=False,  # asked for with BPF_TOOLS: a build that cannot make it fails
        )
    ]
    if BPF_TOOLS
    else []
)

setup(
    cmdclass={"build_ext": BuildWithGuardObject},
    ext_modules=[
        *ALLOCGUARD,
        Extension(
            "gpuguard.adapters.nvml._gate",
            sources=["gpuguard/adapters/nvml/_gate.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
    ],
)
