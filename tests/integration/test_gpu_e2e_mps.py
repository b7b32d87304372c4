"""``scripts/gpu_e2e.py --mps-trials`` without a GPU: a tenant's own MPS beside ordinary
processes, with a stand-in ``nvidia-cuda-mps-control`` and CUDA-free workers.

The stand-in control program (written into the test's directory, first on PATH) does what the
script relies on: ``-d`` returns at once and leaves a daemon (a session of its own, in the
cgroup it was started in) that makes its control FIFO in ``$CUDA_MPS_PIPE_DIRECTORY``, logs to
``$CUDA_MPS_LOG_DIRECTORY/control.log`` and spawns a server (its child, holding the stand-in GPU
device open, listed with 256 MiB); ``quit`` on stdin of a second call goes through the FIFO,
stops the server and ends the daemon; with no daemon listening that call exits 1. The driver of
the NVML stand-in lists a process as an MPS client when the pipe directory it was started with
holds a daemon's FIFO (the server excepted), as the driver lists a process connected to MPS.

What is tested: ``MpsDaemon`` puts the daemon and the server it spawns into the tenant's
container cgroup, keeps ordinary processes off it, quits it through its own pipe (idempotent),
and kills by pidfd what stays of it when it ignores ``quit``; a trial interrupted by SIGTERM
(the script's handler raises) still quits its daemon and kills its client;
``gpu_e2e.main --mps-trials 1`` on the stand-in with the real enforcer (MPS not declared): the
tenant's client and server are charged to the tenant, its ordinary process and the neighbour's
are both stopped, nothing else is signalled; and without the program the MPS rows say
``skipped: no nvidia-cuda-mps-control``. What NVML and MPS do on a real GPU runs only there
(docs/gpu-e2e.md).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rigs.cgroups import CgroupTree, cgroup_dir, kernel_problem
from rigs.controlplane import wait_until
from rigs.nvml_stub import Scenario
from rigs.prereq import require
from tests.integration.e2e_standin import StandinDriver, run_on_standin
from tests.scripts_loader import load_script

pytestmark = [pytest.mark.kernel, pytest.mark.nvml_stub]

STANDIN_WORKER = Path(__file__).resolve().parent / "e2e_standin_worker.py"

FAKE_CONTROL = '''#!PYTHON
"""A stand-in for nvidia-cuda-mps-control (tests/integration/test_gpu_e2e_mps.py)."""
import os
import subprocess
import sys

control = os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control")
SERVER = """
import os, pathlib, time
device = os.open(os.environ["GPU_E2E_STANDIN_DEVICE"], os.O_PATH)
pathlib.Path(os.environ["GPU_E2E_STANDIN_DIR"], str(os.getpid())).write_text(str(256 << 20))
while True:
    time.sleep(3600)
"""
if sys.argv[1:] == ["-d"]:
    if os.fork():
        os._exit(0)  # the caller's part returns at once; the daemon stays
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    log_dir = os.environ["CUDA_MPS_LOG_DIRECTORY"]
    log = open(os.path.join(log_dir, "control.log"), "a", buffering=1)
    os.mkfifo(control)
    server = subprocess.Popen([sys.executable, "-c", SERVER, "nvidia-cuda-mps-server"])
    log.write(f"daemon {os.getpid()} started server {server.pid}\\n")
    fifo = os.open(control, os.O_RDWR)  # read and write: never an end of file
    while True:
        if b"quit" in os.read(fifo, 4096) and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
            server.terminate()
            server.wait()
            os.unlink(control)
            log.write("quit\\n")
            os._exit(0)
try:
    fifo = os.open(control, os.O_WRONLY | os.O_NONBLOCK)
except OSError:
    print("Cannot find MPS control daemon process", file=sys.stderr)
    sys.exit(1)
os.write(fifo, sys.stdin.read().encode())
'''


def fake_control(bin_dir: Path) -> Path:
    """The stand-in ``nvidia-cuda-mps-control`` in ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-cuda-mps-control"
    path.write_text(FAKE_CONTROL.replace("PYTHON", sys.executable, 1))
    path.chmod(0o755)
    return path


def mps_client(pid: int) -> bool:
    """Started with a pipe directory that holds a daemon's FIFO, and not a server itself."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"nvidia-cuda-mps-server" in cmdline:
        return False
    for entry in environ:
        if entry.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            return (Path(entry.split(b"=", 1)[1].decode()) / "control").exists()
    return False


class MpsScenario(Scenario):
    """Every document written with the MPS clients moved to the device's MPS-client list."""

    def write(self, data: dict[str, Any]) -> None:
        for device in data["devices"]:
            clients = [p for p in device["processes"] if mps_client(p["pid"])]
            device["processes"] = [p for p in device["processes"] if p not in clients]
            device["mps_processes"] = clients
        super().write(data)


class MpsStandinDriver(StandinDriver):
    """The e2e stand-in driver, listing MPS clients apart."""

    def __init__(self, scenario: Scenario, usage_dir: Path) -> None:
        super().__init__(MpsScenario(scenario.path), usage_dir)


@pytest.fixture
def e2e() -> Iterator[ModuleType]:
    yield load_script("gpu_e2e")
    sys.modules.pop("gpu_e2e", None)


@pytest.fixture
def pod_cgroup() -> Iterator[tuple[Path, str]]:
    """One container cgroup (its directory, its path as /proc/<pid>/cgroup shows it)."""
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    tree = CgroupTree()
    try:
        cg = tree.make(2, "pod-mps/ctr")
        yield cgroup_dir(cg), cg.path
    finally:
        tree.close()


def test_a_tenants_daemon_and_its_server_live_in_its_pod_cgroup_and_quit_through_its_pipe(
    e2e: ModuleType,
    pod_cgroup: tuple[Path, str],
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod, path = pod_cgroup
    monkeypatch.setenv("GPU_E2E_STANDIN_DEVICE", str(device_node))
    monkeypatch.setenv("GPU_E2E_STANDIN_DIR", str(tmp_path))
    daemon = e2e.MpsDaemon(str(fake_control(tmp_path / "bin")), pod)
    try:
        assert daemon.start() is None
        (pid,) = daemon.pids
        assert e2e.process_facts(pid)["cgroup"] == path
        wait_until(lambda: daemon.note_servers(), timeout=10, what="the daemon's server")
        (server,) = daemon.note_servers()
        assert server["ppid"] == pid
        assert server["cgroup"] == path, "the server left the tenant's cgroup"
        assert sorted(e2e.Cgroups.members(pod)) == sorted([pid, server["pid"]])
        assert "control" in daemon.facts["pipe_directory_files"]
        assert daemon.env()["CUDA_MPS_PIPE_DIRECTORY"] == daemon.facts["pipe_directory"]
        ordinary = Path(daemon.ordinary_env()["CUDA_MPS_PIPE_DIRECTORY"])
        assert ordinary != Path(daemon.facts["pipe_directory"])
        assert list(ordinary.iterdir()) == [], "a daemon listens where ordinary processes look"
    finally:
        daemon.stop()
    daemon.stop()  # a second stop (atexit's) does nothing
    assert daemon.facts["quit"]["rc"] == 0
    assert daemon.facts["left_after_quit"] == []
    assert e2e.Cgroups.members(pod) == []
    assert "quit" in daemon.facts["control_log"]
    assert not daemon.root.exists()


def test_what_stays_of_a_daemon_that_ignores_quit_is_killed(
    e2e: ModuleType,
    pod_cgroup: tuple[Path, str],
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod, _ = pod_cgroup
    monkeypatch.setenv("GPU_E2E_STANDIN_DEVICE", str(device_node))
    monkeypatch.setenv("GPU_E2E_STANDIN_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_MPS_IGNORE_QUIT", "1")
    daemon = e2e.MpsDaemon(str(fake_control(tmp_path / "bin")), pod)
    daemon.quit_wait_seconds = 0.5
    try:
        assert daemon.start() is None
        wait_until(lambda: daemon.note_servers(), timeout=10, what="the daemon's server")
        (server,) = daemon.note_servers()
    finally:
        daemon.stop()
    assert daemon.facts["quit"]["rc"] == 0
    assert sorted(daemon.facts["left_after_quit"]) == sorted([*daemon.pids, server["pid"]])
    wait_until(lambda: e2e.Cgroups.members(pod) == [], timeout=10, what="the daemon killed")


class InterruptedNvml:
    """NVML as a SIGTERM finds it: the script's handler raises at the first listing."""

    def listing(self) -> dict[str, Any]:
        raise KeyboardInterrupt("signal 15")


def test_an_mps_trial_interrupted_by_sigterm_still_quits_its_daemon_and_stops_its_client(
    e2e: ModuleType,
    pod_cgroup: tuple[Path, str],
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod_dir, path = pod_cgroup
    monkeypatch.setenv("GPU_E2E_STANDIN_DEVICE", str(device_node))
    monkeypatch.setenv("GPU_E2E_STANDIN_DIR", str(tmp_path))
    monkeypatch.setattr(e2e, "WORKER", STANDIN_WORKER)
    pod = e2e.PodSpec(
        name=e2e.MPS_TENANT, limit_bytes=4 << 30, cgroup_dir=pod_dir, cgroup_path=path
    )
    setup = e2e.MpsTrialSetup(
        control=str(fake_control(tmp_path / "bin")), tenant=pod, neighbour=pod,
        nvml=InterruptedNvml(), port=1, records=tmp_path / "records.jsonl",
        limit_bytes=4 << 30, grow_to_mib=8192, client_mib=100, timeout=5.0,
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        e2e.run_mps_trial(setup, 0)
    # The client was up (it holds its memory), then the daemon, its server and the client went.
    assert [r["kind"] for r in _records(tmp_path / "records.jsonl")] == ["ready", "held"]
    assert e2e.Cgroups.members(pod_dir) == []
    assert not list(Path(tempfile.gettempdir()).glob("gpuguard-e2e-mps-*/pipe/control"))


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_an_mps_trial_on_the_stand_in_stops_both_ordinary_processes_and_charges_the_tenant(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``gpu_e2e.main --mps-trials 1`` itself (run_on_standin with the driver that lists MPS
    clients apart), judged by the script (exit 0) and read back from its results.json."""
    bin_dir = tmp_path / "bin"
    fake_control(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "0", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--mps-trials", "1", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
        driver_class=MpsStandinDriver,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert {k: v["ok"] for k, v in result["summary"].items()} == {
        "mps-neighbour": 1,
        "mps-tenant": 1,
    }
    assert result["wrong_kills"] == []
    assert result["mps"]["control"] == str(bin_dir / "nvidia-cuda-mps-control")
    assert result["mps"]["skipped"] is None
    (facts,) = result["mps"]["trials"]
    assert facts["client_in_mps_list"] is True
    assert facts["client_in_compute_list"] is False
    assert facts["ordinary_in_mps_list"] == []
    assert facts["tenant_charged_bytes"] > 0
    assert [s["cgroup"] for s in facts["servers"]] == [result["cgroups"]["mps-tenant"]]
    assert [d["cgroup"] for d in facts["daemon"]] == [result["cgroups"]["mps-tenant"]]
    # Stopping the tenant's container reached its client; stopping the neighbour's, nothing MPS.
    assert facts["client"]["pid"] in result["mps"]["tenant_stop_signalled_mps_pids"]
    assert {s["pod"] for s in result["enforcer_signals"]} == {"mps-tenant", "mps-neighbour"}
    # The tenant's stop ended the daemon with its container: no quit to a pipe nobody reads.
    assert facts["quit"]["output"] == "not sent: the daemon was gone"
    assert facts["left_after_quit"] == []
    trials = {t["label"]: t for t in result["trials"]}
    assert set(trials) == {"mps-tenant-0", "mps-neighbour-0"}
    for t in trials.values():
        assert t["cross_to_term_s"] is not None
        assert t["mps_index"] == 0
    assert "mps 0: daemon" in printed


def test_mps_trials_without_nvidia_cuda_mps_control_are_reported_skipped(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No program: the MPS rows say so in the table and in results.json, and the run is judged
    on its other trials (one greedy here)."""
    monkeypatch.setattr(e2e, "MPS_CONTROL_DIRS", ())
    dirs = os.environ["PATH"].split(os.pathsep)
    without = [d for d in dirs if not (Path(d) / "nvidia-cuda-mps-control").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(without))
    assert e2e.find_mps_control() is None
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "1", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--mps-trials", "2", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["mps"]["skipped"] == "skipped: no nvidia-cuda-mps-control"
    assert result["machine"]["commit"]  # this checkout's HEAD (a GPU run names its archive's)
    assert result["mps"]["trials"] == []
    assert set(result["summary"]) == {"greedy"}
    rows = {line.split()[0]: line for line in printed.splitlines() if line.startswith("mps-")}
    assert rows.keys() == {"mps-tenant", "mps-neighbour"}
    assert all(line.endswith("skipped: no nvidia-cuda-mps-control") for line in rows.values())
