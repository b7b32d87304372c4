"""``gpuguard explain``: the DESIGN §5.2 JSON contract, the human text and the exit codes, over
fixture ``/proc`` trees and through the real CLI in a subprocess."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.explain import explain, render_explain_human, run_explain
from gpuguard.core.model import Attribution
from gpuguard.errors import KubeError

FIXTURES = Path(__file__).parent / "fixtures" / "proc"
UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
C = "a" * 60 + "c0de"
CONTRACT: dict[str, type | tuple[type, ...]] = {
    "pid": int,
    "is_pod": bool,
    "pod_uid": (str, type(None)),
    "container_id": (str, type(None)),
    "runtime": (str, type(None)),
    "cgroup_version": int,
    "reason": (str, type(None)),
}


def assert_contract(d: Mapping[str, Any]) -> None:
    for key, types in CONTRACT.items():
        assert key in d, key
        assert isinstance(d[key], types), (key, d[key])
    assert d["runtime"] in ("containerd", "cri-o", "docker", None)
    assert d["cgroup_version"] in (1, 2)
    if not d["is_pod"]:
        assert isinstance(d["reason"], str)
        assert d["reason"]
        assert d["pod_uid"] is None
    else:
        assert len(d["pod_uid"]) in (32, 36)
    json.dumps(d)  # serialisable as is


def test_a_crio_crun_pod_process_meets_the_contract() -> None:
    d = explain(1001, proc_root=FIXTURES, offline=True)
    assert_contract(d)
    assert d["pid"] == 1001
    assert d["is_pod"] is True
    assert d["pod_uid"] == UID
    assert d["container_id"] == C
    assert d["runtime"] == "cri-o"
    assert d["cgroup_version"] == 2
    assert d["reason"] is None
    assert d["start_ticks"] == 88001
    assert d["cgroup_lines"][0].startswith("0::/kubepods.slice/")
    assert d["cgroup"].endswith(f"crio-{C}.scope")


def test_crio_conmon_is_not_a_pod() -> None:
    d = explain(1006, proc_root=FIXTURES, offline=True)
    assert_contract(d)
    assert d["is_pod"] is False
    assert "conmon" in d["reason"]


def test_a_static_pod_reports_its_config_hash() -> None:
    d = explain(1004, proc_root=FIXTURES)
    assert_contract(d)
    assert d["pod_uid"] == "6a1a0f3c2b9e4d8f9a7b6c5d4e3f2a1b"


def test_a_pid_not_in_proc_is_not_a_pod_with_a_reason() -> None:
    d = explain(4_000_000, proc_root=Path("/proc"), offline=True)
    assert_contract(d)
    assert d["reason"] == "not in /proc"
    assert d["in_proc"] is False


def test_offline_never_calls_the_pod_lookup() -> None:
    def lookup(_: Attribution) -> Mapping[str, Any] | None:
        raise AssertionError("called offline")

    d = explain(1001, proc_root=FIXTURES, offline=True, pod_lookup=lookup)
    assert "pod_found" not in d


def test_online_lookup_fills_the_placeholders() -> None:
    seen: list[Attribution] = []

    def lookup(a: Attribution) -> Mapping[str, Any] | None:
        seen.append(a)
        return {"pod_namespace": "ml", "pod_name": "train-0", "limit_bytes": 8 << 30,
                "limit_source": "annotation", "is_pod": False}  # fmt: skip

    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lookup)
    assert_contract(d)
    assert seen[0].pod_uid == UID
    assert d["pod_found"] is True
    assert (d["pod_namespace"], d["pod_name"], d["limit_bytes"]) == ("ml", "train-0", 8 << 30)
    assert d["is_pod"] is True  # a lookup cannot override the contract keys
    assert d["gpu_used_bytes"] is None
    text = render_explain_human(d)
    assert "ml/train-0" in text
    assert "annotation" in text


def test_an_unknown_pod_and_a_failed_lookup_are_reported() -> None:
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: None)
    assert d["pod_found"] is False
    assert "no such pod" in render_explain_human(d)

    def failing(_: Attribution) -> Mapping[str, Any] | None:
        raise KubeError("connection refused")

    args = argparse.Namespace(pid=1001, proc_root=str(FIXTURES), offline=False, json=True)
    out = io.StringIO()
    assert run_explain(args, stdout=out, pod_lookup=failing) == 1
    assert json.loads(out.getvalue())["pod_lookup_error"] == "connection refused"


def test_human_text_says_why_not_a_pod() -> None:
    text = render_explain_human(explain(1007, proc_root=FIXTURES))
    assert "not a pod process: no kubepods cgroup" in text
    assert "0::/system.slice/nvidia-persistenced.service" in text


@pytest.mark.parametrize(
    ("pid", "proc_root", "code"),
    [(1001, FIXTURES, 0), (4_000_000, FIXTURES, 0), (0, FIXTURES, 1), (-3, FIXTURES, 1),
     (1001, FIXTURES / "nope", 1)],
)  # fmt: skip
def test_exit_codes(pid: int, proc_root: Path, code: int) -> None:
    args = argparse.Namespace(pid=pid, proc_root=str(proc_root), offline=True, json=False)
    assert run_explain(args, stdout=io.StringIO(), stderr=io.StringIO()) == code


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard.cli", "explain", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def test_the_cli_prints_one_json_document_meeting_the_contract() -> None:
    done = _cli("1001", "--proc-root", str(FIXTURES), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert_contract(d)
    assert (d["pod_uid"], d["container_id"], d["runtime"]) == (UID, C, "cri-o")


def test_the_cli_explains_itself_as_a_real_process() -> None:
    done = _cli(str(os.getpid()), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert_contract(d)
    assert d["pid"] == os.getpid()
    assert d["in_proc"] is True


def test_the_cli_rejects_a_non_numeric_pid_as_a_usage_error() -> None:
    assert _cli("abc").returncode == 2
