"""scripts/pack-apiserver.sh writes xz files that scripts/gpu_e2e.py's ``--apiserver`` mode
unpacks to the very binaries it packed (run on small stand-in executables: ``xz -9e`` on the
real 119 MB kube-apiserver takes minutes; the sizes are in docs/gpu-e2e.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rigs.prereq import require
from tests.scripts_loader import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pack-apiserver.sh"


def pack(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={**os.environ, "TESTBIN_DIR": str(src)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_packed_binaries_unpack_to_the_same_executables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(shutil.which("xz") is not None, "needs xz (apt-get install xz-utils)")
    src = tmp_path / "bin"
    src.mkdir()
    for name, donor in (("etcd", "/bin/true"), ("kube-apiserver", "/bin/false")):
        shutil.copy(donor, src / name)
    done = pack(src, tmp_path / "packed")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == [
        "etcd.xz",
        "kube-apiserver.xz",
    ]
    assert "total" in done.stdout

    monkeypatch.setenv("TESTBIN_DIR", str(tmp_path / "packed"))
    work = tmp_path / "work"
    work.mkdir()
    found = load_script("gpu_e2e").ApiServer._binaries(work)
    for name in ("etcd", "kube-apiserver"):
        assert found[name] == work / "bin" / name
        assert found[name].read_bytes() == (src / name).read_bytes()
        assert os.access(found[name], os.X_OK)
    assert subprocess.run([found["etcd"]], check=False).returncode == 0  # /bin/true runs
    assert subprocess.run([found["kube-apiserver"]], check=False).returncode == 1


def test_a_missing_binary_is_an_error_and_nothing_is_written(tmp_path: Path) -> None:
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy("/bin/true", src / "etcd")
    done = pack(src, tmp_path / "packed")
    assert done.returncode == 1
    assert "kube-apiserver" in done.stderr
    assert not (tmp_path / "packed").exists()
