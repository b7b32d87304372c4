"""The Go-building ensure scripts started twice at once (``make gobins`` and a test's fixture,
or two test sessions) build each binary once and both succeed.

Before the lock, both wrote ``$DEST/.kwok.tmp`` and the second ``mv`` failed ("cannot stat"):
``make gobins`` reported ensure-controlplane failed on a fresh machine. A stand-in ``go`` first
on ``PATH`` (the scripts append the real one's directory last) takes a second per build and
counts its builds, so the race is certain and the test costs seconds, not a real build.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAND_IN_GO = """#!/usr/bin/env bash
set -eu
case "$1" in
  version) echo "go version go1.26.8 linux/amd64" ;;
  build)
    out=""; prev=""
    for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
    echo "$$" >> "$GO_BUILDS"
    sleep 1
    printf '#!/bin/sh\\necho stand-in 1.0\\n' > "$out"; chmod +x "$out" ;;
  *) echo "stand-in go: unexpected $*" >&2; exit 3 ;;
esac
"""

CASES = [
    pytest.param("ensure-controlplane.sh", {"CONTROLPLANE_ONLY": "kwok"}, "CONTROLPLANE_CACHE",
                 id="controlplane"),
    pytest.param("ensure-testbin.sh", {"TESTBIN_ONLY": "etcd"}, "TESTBIN_CACHE", id="testbin"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "only", "cache_var"), CASES)
def test_two_builders_at_once_build_once_and_both_succeed(
    tmp_path: Path, script: str, only: dict[str, str], cache_var: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(STAND_IN_GO)
    go.chmod(0o755)
    builds = tmp_path / "builds"
    env = {
        **os.environ,
        **only,
        cache_var: str(tmp_path / "cache"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "GO_BUILDS": str(builds),
    }
    if script == "ensure-testbin.sh":
        # It points testbin/bin of the repo at the cache: use a copy of the scripts and modules.
        copy = tmp_path / "repo"
        (copy / "scripts").mkdir(parents=True)
        (copy / "testbin").mkdir()
        for module in ("kube-apiserver", "etcd", "helm"):  # what its cache key reads
            subprocess.run(
                ["cp", "-r", str(ROOT / "testbin" / module), str(copy / "testbin")], check=True
            )
        for name in (script, "k8s-go-build.sh", "ensure-lib.sh"):
            (copy / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
        path = copy / "scripts" / script
    else:
        path = ROOT / "scripts" / script
    procs = [
        subprocess.Popen(
            ["bash", str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert len(builds.read_text().split()) == 1, f"built more than once: {outputs}"
    assert any("cached" in out for out in outputs), outputs
