"""The one stop of a started process (``rigs.processes.terminate``, also
``rigs.controlplane.terminate`` and ``Logged.stop``) and the one SIGKILL by pidfd
(``rigs.processes.pidfd_kill``, also ``scripts/gpu_e2e.py``'s and ``rigs/cgroups.py``'s
teardown), on real child processes this test starts and nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys

from rigs import controlplane
from rigs.processes import pidfd_kill, terminate
from tests.scripts_loader import load_script

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def _child(code: str) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    with child.stdout:  # it writes nothing after "ready"
        assert child.stdout.readline() == b"ready\n"
    return child


def test_terminate_ends_a_child_with_sigterm_and_reaps_it() -> None:
    child = _child("import time; print('ready', flush=True); time.sleep(60)")
    assert terminate(child) == -15
    assert child.returncode == -15


def test_terminate_sigkills_a_child_that_ignores_sigterm_after_the_timeout() -> None:
    child = _child(IGNORES_SIGTERM)
    assert terminate(child, timeout=0.5) == -9


def test_terminate_of_nothing_or_of_an_ended_child_sends_nothing() -> None:
    assert terminate(None) is None
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait()
    assert terminate(child) == 3


def test_pidfd_kill_sigkills_a_live_child() -> None:
    child = _child(IGNORES_SIGTERM)
    pidfd_kill(child.pid)
    assert child.wait(10) == -9


def test_pidfd_kill_of_a_child_that_already_exited_is_fine() -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    # Exited, not reaped: its PID stays ours (a zombie), so no other process can hold it.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    pidfd_kill(child.pid)
    assert child.wait(10) == 3


def test_the_tests_and_the_scripts_use_the_one_helper() -> None:
    assert controlplane.terminate is terminate
    assert load_script("gpu_e2e").pidfd_kill is pidfd_kill
