"""Every way ``gpuguard enforce`` ends but SIGKILL closes the allocation guard before the process
exits: its thawer resumes every recorded stop and exits because the guard closed
(``thawer_exited`` with ``why: guard_closed``), not because it saw the enforcer gone. In a
container the runtime kills whatever is left once the main process exits, so a stop left to the
thawer's notice of that exit could outlive the container (docs/install.md, Allocation guard).

The real command (``python -m gpuguard.cli``'s ``main``) over the NVML stand-in, a pods file and
the guard on the libcuda stand-in, with one fault put in by the wrapper below: an exception after
the guard attached and before the event loop runs, a SIGTERM in that same window (before the
loop's own handler), and an exception in a cycle. Each ends the process, and the thawer's last
line must say the guard closed it, before ``enforcer_stopped``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rigs.allocguard import AllocGuardBuild, build
from rigs.nvml_stub import SCENARIO_ENV, Scenario, build_stub
from rigs.prereq import require
from tests.helpers.environment import environ_without_gpuguard_settings
from tests.nvml_stub.fixtures import gpu

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[2]
POD_FILE = ROOT / "tests" / "fixtures" / "pods" / "capped.yaml"

# argv: FAULT, then gpuguard's own arguments.
FAULTY = """
import os, signal, sys
from gpuguard import app
from gpuguard.cli import main
from gpuguard.runtime.enforcer import Enforcer

fault = sys.argv[1]
started = app._log_started
if fault == "raise_at_start":
    def _log_started(*args, **kwargs):
        raise RuntimeError("fault: after the guard attached, before the loop")
    app._log_started = _log_started
elif fault == "sigterm_at_start":
    def _log_started(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the kubelet's, while start-up still runs
        started(*args, **kwargs)
    app._log_started = _log_started
elif fault == "raise_in_a_cycle":
    turn = Enforcer._turn
    turns = []
    async def _turn(self, **kwargs):
        turns.append(1)
        if len(turns) == 3:
            raise RuntimeError("fault: in a cycle")
        return await turn(self, **kwargs)
    Enforcer._turn = _turn
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    return build()


def run_enforcer(tmp: Path, built: AllocGuardBuild, fault: str) -> tuple[int, list[dict[str, Any]]]:
    """The enforcer with the guard on and ``fault``: its exit status and its JSON log lines
    (the thawer's included: it writes to the enforcer's stderr), read once it has exited."""
    scenario = Scenario(tmp / "scenario.json")
    scenario.write({"devices": [gpu(0)]})
    env = environ_without_gpuguard_settings() | {
        "PYTHONPATH": str(ROOT),
        SCENARIO_ENV: str(scenario.path),
        "GPUGUARD_NODE_NAME": "n",
        "GPUGUARD_NVML_LIBRARY_PATH": str(build_stub()),
        "GPUGUARD_ENFORCEMENT_LOCK_FILE": str(tmp / "run" / "enforcer.lock"),
        "GPUGUARD_NODE_POD_RESOURCES_SOCKET": str(tmp / "kubelet.sock"),
        "GPUGUARD_ENFORCEMENT_ALLOC_GUARD": "true",
        "GPUGUARD_ENFORCEMENT_ALLOC_GUARD_LIBRARY": str(built.stub_library),
    }
    argv = ["enforce", "--pods-file", str(POD_FILE), "--metrics-address", "127.0.0.1:0"]
    argv += ["--log-format", "json", "--log-level", "info"]
    log = tmp / "enforcer.log"
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-c", FAULTY, fault, *argv],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        )
    lines = log.read_text(errors="replace").splitlines()
    return done.returncode, [json.loads(ln) for ln in lines if ln.startswith("{")]


@pytest.mark.parametrize(
    ("fault", "code"),
    [("raise_at_start", 1), ("sigterm_at_start", 0), ("raise_in_a_cycle", 1)],
)
def test_an_enforcer_that_fails_or_is_terminated_closes_the_guard_before_it_exits(
    built: AllocGuardBuild, tmp_path: Path, fault: str, code: int
) -> None:
    returncode, lines = run_enforcer(tmp_path, built, fault)
    events = [line["event"] for line in lines]
    assert "alloc_guard_attached" in events, events  # else this proves nothing
    assert returncode == code, events
    exits = [line for line in lines if line["event"] == "thawer_exited"]
    assert [e["why"] for e in exits] == ["guard_closed"], exits
    # Closed before the rest: the enforcer's last line comes after the thawer's.
    assert events.index("thawer_exited") < events.index("enforcer_stopped"), events
    assert events[-1] == "enforcer_stopped", events
