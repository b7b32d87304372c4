"""Start-up and shutdown of ``enforce``, ``agent``, ``inspect`` and ``explain`` go through one
helper (``gpuguard.startup.Startup``): what each opens is closed in reverse, on a normal return,
a signal, or a failure part-way through start-up, and nothing that was not opened is closed.

Each command runs as a user runs it (``python -m gpuguard.cli``'s ``main``, in a process of its
own) on the real adapters: NVML over the C stand-in, a pods file, the node lock, the metrics
server, the kubelet's socket (absent: each read is an unknown answer). The process records what
``startup.watch()`` saw and which threads were still running once ``main`` returned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard import startup
from gpuguard.startup import Startup
from rigs.nvml_stub import SCENARIO_ENV, Scenario
from tests.helpers.environment import environ_without_gpuguard_settings
from tests.nvml_stub.fixtures import stub_lib_fixture  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
POD_FILE = ROOT / "tests" / "fixtures" / "pods" / "capped.yaml"

WATCHED = """
import json, sys, threading
from gpuguard import startup
from gpuguard.cli import main
with startup.watch() as seen:
    try:
        code = main(sys.argv[2:])
    except SystemExit as exc:
        code = exc.code
alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "seen": seen, "threads": alive}, out)
"""

ENFORCE_OPENS = [
    "metrics_server",
    "gpu",
    "node_lock",
    "pod_directory",
    "event_sink",
    "pod_resources",
    "killer",
]
LOOKUP_OPENS = ["pod_directory", "gpu", "pod_resources"]
"""What ``inspect`` and ``explain`` open, in order, with a pods file."""


def opened_then_closed_in_reverse(names: list[str]) -> list[list[str]]:
    return [["opened", n] for n in names] + [["closed", n] for n in reversed(names)]


class Watched:
    """``gpuguard ARGS`` in a process of its own, ``startup.watch()`` around its ``main``."""

    def __init__(self, tmp_path: Path, stub_lib: Path, *, nvml: dict[str, Any]) -> None:
        scenario = Scenario(tmp_path / "scenario.json")
        scenario.write(nvml)
        self.report = tmp_path / "report.json"
        self.log = tmp_path / "stdout.log"
        self.env = environ_without_gpuguard_settings() | {
            "PYTHONPATH": str(ROOT),
            "GPUGUARD_NODE_NAME": "n",
            SCENARIO_ENV: str(scenario.path),
            "GPUGUARD_NVML_LIBRARY_PATH": str(stub_lib),
            "GPUGUARD_ENFORCEMENT_LOCK_FILE": str(tmp_path / "run" / "enforcer.lock"),
            "GPUGUARD_NODE_POD_RESOURCES_SOCKET": str(tmp_path / "kubelet.sock"),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *argv: str) -> None:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", WATCHED, str(self.report), *argv],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_for(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text(errors="replace"):
            assert self.process is not None
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, *, sigterm: bool = False, timeout: float = 60) -> dict[str, Any]:
        assert self.process is not None
        if sigterm:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        assert self.process.returncode == 0, self.output()
        report: dict[str, Any] = json.loads(self.report.read_text())
        return report

    def run(self, *argv: str) -> dict[str, Any]:
        self.start(*argv)
        return self.finish()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def events(self) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [json.loads(line)["event"] for line in lines if line.startswith("{")]


ONE_GPU = {"devices": [{"uuid": "GPU-1", "name": "NVIDIA H100", "total_bytes": 80 << 30}]}
NVML_FAILS = {"init_error": "DRIVER_NOT_LOADED", "devices": []}
ENFORCE = ["enforce", "--node-name", "n", "--pods-file", str(POD_FILE)]
ENFORCE += ["--metrics-address", "127.0.0.1:0", "--log-format", "json"]


@pytest.mark.nvml_stub
def test_enforce_closes_what_it_opened_in_reverse_when_sigterm_ends_it(
    stub_lib: Path, tmp_path: Path
) -> None:
    """The killer is closed too (its helper thread of member reads let go): it was not, before
    the helper."""
    watched = Watched(tmp_path, stub_lib, nvml=ONE_GPU)
    watched.start(*ENFORCE, "--log-level", "info")
    watched.wait_for('"enforcer_started"')
    report = watched.finish(sigterm=True)
    assert report["code"] == 0, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(ENFORCE_OPENS)
    assert "gpuguard-pods-file" not in report["threads"]
    assert "metrics-http" not in report["threads"]
    events = watched.events()
    assert events[-1] == "enforcer_stopped", events
    assert "enforcer_failed" not in events


@pytest.mark.nvml_stub
def test_a_sigterm_during_enforce_start_up_closes_what_was_opened_and_exits_0(
    stub_lib: Path, tmp_path: Path
) -> None:
    """The kubelet's SIGTERM can come before the event loop takes the signal over (start-up
    still opening, or ``enforcer_started`` logged and the loop not yet running): it used to end
    the process by the default action (-15) with the node lock, the metrics server, NVML and
    the allocation guard never closed."""
    watched = Watched(tmp_path, stub_lib, nvml=ONE_GPU)
    watched.start(*ENFORCE, "--log-level", "info")
    watched.wait_for('"config_loaded"')
    report = watched.finish(sigterm=True)
    assert report["code"] == 0, watched.output()
    opened = [name for verb, name in report["seen"] if verb == "opened"]
    assert report["seen"] == opened_then_closed_in_reverse(opened)


@pytest.mark.nvml_stub
def test_a_failure_part_way_through_enforce_start_up_closes_what_was_opened_and_nothing_else(
    stub_lib: Path, tmp_path: Path
) -> None:
    """An invalid pods file fails the pod directory's start, after the metrics server, NVML and
    the node lock were opened: those three are closed, last first; nothing later is."""
    bad = tmp_path / "pods.yaml"
    bad.write_text("kind: PodList\nitems: [")
    watched = Watched(tmp_path, stub_lib, nvml=ONE_GPU)
    argv = [a if a != str(POD_FILE) else str(bad) for a in ENFORCE]
    report = watched.run(*argv, "--log-level", "info")
    assert report["code"] == 2, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(["metrics_server", "gpu", "node_lock"])
    events = watched.events()
    assert events[-1] == "enforcer_stopped", events
    assert "enforcer_started" not in events


@pytest.mark.nvml_stub
def test_enforce_without_nvml_closes_only_the_metrics_server_and_logs_no_stop(
    stub_lib: Path, tmp_path: Path
) -> None:
    watched = Watched(tmp_path, stub_lib, nvml=NVML_FAILS)
    report = watched.run(*ENFORCE, "--log-level", "info")
    assert report["code"] == 1, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(["metrics_server"])
    assert "enforcer_stopped" not in watched.events()


@pytest.mark.nvml_stub
def test_inspect_closes_the_pods_nvml_and_the_kubelet_reader_in_reverse(
    stub_lib: Path, tmp_path: Path
) -> None:
    watched = Watched(tmp_path, stub_lib, nvml=ONE_GPU)
    report = watched.run("inspect", "--pods-file", str(POD_FILE), "--json")
    assert report["code"] == 0, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(LOOKUP_OPENS)


@pytest.mark.nvml_stub
def test_inspect_stops_the_pod_directory_it_opened_when_nvml_cannot_start(
    stub_lib: Path, tmp_path: Path
) -> None:
    """Before the helper, NVML failing left the pods file's watcher thread running."""
    watched = Watched(tmp_path, stub_lib, nvml=NVML_FAILS)
    report = watched.run("inspect", "--pods-file", str(POD_FILE))
    assert report["code"] == 1, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(["pod_directory"])
    assert "gpuguard-pods-file" not in report["threads"]


@pytest.mark.nvml_stub
def test_explain_closes_the_pods_nvml_and_the_kubelet_reader_in_reverse(
    stub_lib: Path, tmp_path: Path
) -> None:
    watched = Watched(tmp_path, stub_lib, nvml=ONE_GPU)
    report = watched.run("explain", str(os.getpid()), "--pods-file", str(POD_FILE), "--json")
    assert report["code"] == 0, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(LOOKUP_OPENS)
    assert "gpuguard-pods-file" not in report["threads"]


def _kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig for an API server that refuses every connection: the agent's sources start
    and retry, which is all its start-up and shutdown need."""
    path = tmp_path / "kubeconfig"
    cluster = {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(config))
    return path


def test_the_agent_closes_its_sources_and_server_in_reverse_when_sigterm_ends_it(
    tmp_path: Path,
) -> None:
    watched = Watched(tmp_path, Path("/nonexistent"), nvml={"devices": []})
    watched.start(
        "agent", "--node-name", "n", "--kubeconfig", str(_kubeconfig(tmp_path)),
        "--metrics-address", "127.0.0.1:0", "--log-format", "json", "--log-level", "info",
    )  # fmt: skip
    watched.wait_for('"agent_started"')
    report = watched.finish(sigterm=True)
    assert report["code"] == 0, watched.output()
    assert report["seen"] == opened_then_closed_in_reverse(
        ["metrics_server", "sharing_source", "event_sink"]
    )
    assert watched.events()[-1] == "agent_stopped"


def test_a_close_that_raises_leaves_the_earlier_ones_to_run_and_surfaces_itself() -> None:
    closed: list[str] = []

    def fails() -> None:
        closed.append("second")
        raise OSError("close failed")

    def hold_both() -> None:
        with Startup() as held:
            held.opened("first", lambda: closed.append("first"))
            held.opened("second", fails)

    with startup.watch() as seen, pytest.raises(OSError, match="close failed"):
        hold_both()
    assert closed == ["second", "first"]
    assert seen == [
        ("opened", "first"),
        ("opened", "second"),
        ("closed", "second"),
        ("closed", "first"),
    ]
