"""The host-PID-namespace self-check (DESIGN §4): fixture status files, the real one, and real
child PID namespaces made with ``unshare`` (with and without their own /proc)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.adapters.signals import INIT_PID_NAMESPACE_INODE, check_host_pid_namespace
from tests.kernel.cgroups import require

STATUS_HOST = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\nNSsid:\t1\n"
STATUS_NESTED = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\t7\nNSsid:\t1\n"
STATUS_TWICE_NESTED = "Name:\tgpuguard\nNSpid:\t4242\t77\t1\n"
STATUS_OLD_KERNEL = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\n"


def status_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "status"
    p.write_text(text)
    return p


def ns_link(tmp_path: Path, target: str) -> Path:
    """A symlink whose target text is what readlink(/proc/self/ns/pid) returns."""
    link = tmp_path / "ns-pid"
    link.symlink_to(target)
    return link


def test_one_nspid_field_in_the_initial_namespace_is_the_host(tmp_path: Path) -> None:
    check = check_host_pid_namespace(
        status_file(tmp_path, STATUS_HOST),
        ns_link(tmp_path, f"pid:[{INIT_PID_NAMESPACE_INODE}]"),
    )

    assert check.ok
    assert check.reason is None


@pytest.mark.parametrize("status", [STATUS_NESTED, STATUS_TWICE_NESTED])
def test_more_than_one_nspid_field_is_refused_with_what_was_seen_and_the_fix(
    tmp_path: Path, status: str
) -> None:
    check = check_host_pid_namespace(status_file(tmp_path, status), None)

    assert not check.ok
    assert check.reason == "not_host_pid_namespace"
    assert "NSpid" in check.detail
    assert "hostPID: true" in check.detail


def test_one_nspid_field_in_a_child_namespace_with_its_own_proc_is_refused(
    tmp_path: Path,
) -> None:
    check = check_host_pid_namespace(
        status_file(tmp_path, STATUS_HOST), ns_link(tmp_path, "pid:[4026532179]")
    )

    assert not check.ok
    assert check.reason == "not_host_pid_namespace"
    assert "4026532179" in check.detail


def test_a_missing_nspid_line_or_status_file_is_unknown_and_refused(tmp_path: Path) -> None:
    old = check_host_pid_namespace(status_file(tmp_path, STATUS_OLD_KERNEL), None)
    missing = check_host_pid_namespace(tmp_path / "no-such-status", None)

    assert (old.ok, old.reason) == (False, "pid_namespace_unknown")
    assert (missing.ok, missing.reason) == (False, "pid_namespace_unknown")


def test_an_unreadable_namespace_link_leaves_the_decision_to_nspid(tmp_path: Path) -> None:
    host = check_host_pid_namespace(status_file(tmp_path, STATUS_HOST), tmp_path / "absent")
    nested = check_host_pid_namespace(status_file(tmp_path, STATUS_NESTED), tmp_path / "absent")

    assert host.ok
    assert not nested.ok


def test_the_real_process_passes_when_it_is_in_the_initial_pid_namespace() -> None:
    # Independent oracle: stat(2) of the namespace file, not readlink(2) as the check does.
    in_host = os.stat("/proc/self/ns/pid").st_ino == INIT_PID_NAMESPACE_INODE
    require(in_host, "the test runner is not in the initial PID namespace")

    check = check_host_pid_namespace()

    assert (check.ok, check.reason, check.detail) == (True, None, "in the host PID namespace")


CHECK_INSIDE = (
    "import json; from gpuguard.adapters.signals import check_host_pid_namespace as c; "
    "r = c(); print(json.dumps({'ok': r.ok, 'reason': r.reason, 'detail': r.detail}))"
)


@pytest.mark.kernel
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--mount-proc"], id="own-proc-one-nspid-field"),
        pytest.param([], id="host-proc-two-nspid-fields"),
    ],
)
def test_a_real_child_pid_namespace_refuses(flags: list[str]) -> None:
    require(os.geteuid() == 0, "unshare --pid needs root")
    require(shutil.which("unshare") is not None, "unshare (util-linux) not installed")
    repo = Path(__file__).resolve().parents[1]

    out = subprocess.run(
        ["unshare", "--pid", "--fork", *flags, sys.executable, "-c", CHECK_INSIDE],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)

    assert result["ok"] is False
    assert result["reason"] == "not_host_pid_namespace"
    assert "hostPID: true" in result["detail"]
