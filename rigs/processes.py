"""Processes the rigs start and watch: gpuguard (or any watcher) as a subprocess, started with
its argv and environment, its output in a log, waited for until it serves, scraped through
prometheus_client's parser, and stopped by its PID (``terminate``, ``Logged``, ``Gpuguard``) or
by a pidfd (``pidfd_kill``); a process's figures from ``/proc``; a free loopback port; a
``/dev/nvidia0`` look-alike and the scripts of pretend GPU processes that hold it (``REAPER``,
``ZYGOTE``). Used by the benchmarks, the scripts and the tests alike (``rigs.controlplane`` and
``rigs.cgroups`` stop their processes with it).

Standard library only at import (``prometheus_client`` is imported when metrics are parsed):
``benchmarks/violation_cost.py``'s worker imports gpuguard from another source tree and must not
get this checkout's, and ``python -m benchmarks.reaction --mode gpu`` runs on a GPU node with
only its dependencies.

Must not: signal a process its caller did not start (a process is stopped through its own
``Popen``, by PID, or by a pidfd of a PID it started, never by name), or listen on anything but
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
_libc = ctypes.CDLL(None, use_errno=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# /proc


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (field 3, the state, first); ``None`` when
    the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot); ``None`` when the process is
    gone or a zombie. With the PID it names one process for good."""
    fields = stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """CPU seconds of process ``pid`` (all its threads, dead ones too), plus its waited-for
    children's with ``children`` (``cutime`` + ``cstime``); ``None`` when it is gone. The
    process's own part is read at nanosecond resolution from its CPU-time clock
    (``clock_getcpuclockid``) where the kernel gives it, else in ticks (``utime`` + ``stime``):
    an idle watcher uses well under a 10 ms tick per second."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    waited = (int(fields[13]) + int(fields[14])) / CLK_TCK if children else 0.0
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        with contextlib.suppress(OSError):
            return time.clock_gettime(clock.value) + waited
    return (int(fields[11]) + int(fields[12])) / CLK_TCK + waited


def _status(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident memory (``VmRSS``); ``None`` when the process is gone."""
    kib = _status(pid, "VmRSS")
    return None if kib is None else kib * 1024


def threads(pid: int) -> int | None:
    """Threads of the process (``Threads`` of its status); ``None`` when it is gone."""
    return _status(pid, "Threads")


def open_fds(pid: int) -> int | None:
    """Open file descriptors (entries of ``/proc/<pid>/fd``); ``None`` when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Files


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log, one a line; other lines (a traceback, text logs) skipped."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
    return out


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one rename (a new inode: the NVML stand-in re-reads its scenario)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# A pod's GPU processes


def gpu_device_node(path: Path) -> Path:
    """A ``/dev/nvidia0`` look-alike (char 195:0) at ``path``, replacing what is there: a
    process holding it open passes the enforcer's ``holds_gpu`` check as a CUDA process would.
    Needs root (``mknod``)."""
    path.unlink(missing_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(195, 0))
    return path


REAPER = r"""
CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
          signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT, signal.SIGPIPE)

def reap(signum, frame):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        on_exit(pid, os.waitstatus_to_exitcode(status))
"""
"""A part of a script that forks pretend GPU processes (``ZYGOTE``; the swarm of
``tests/integration/test_faults.py``): ``CAUGHT``, the signals a pretend process catches and
records (every one the enforcer could send by mistake), and ``reap``, a ``SIGCHLD`` handler that
reaps every exited child and calls the script's own ``on_exit(pid, code)``. The script imports
``os`` and ``signal`` before it."""

ZYGOTE = (
    r"""
import ctypes, gc, os, signal, sys, time
record, device, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
gpu_fd = os.open(device, os.O_PATH)  # inherited by every child: /proc/<pid>/fd shows chr 195:0
libc = ctypes.CDLL(None)
zygote = os.getpid()
residents = set()

def note(line):
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{time.time():.3f} {line}\n".encode())
    os.close(fd)

def on_signal(signum, frame):
    note(f"signal {os.getpid()} {signal.Signals(signum).name}")
    if signum == signal.SIGTERM:
        os._exit(143)

def on_exit(pid, code):
    if code != 0 or pid in residents:
        note(f"exit {pid} {code}")
"""
    + REAPER
    + r"""
for s in CAUGHT:
    signal.signal(s, on_signal)
signal.signal(signal.SIGCHLD, reap)
gc.freeze()  # the children touch as few pages as they can

def fork(seconds):
    pid = os.fork()
    if pid == 0:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: they go with their zygote
        if os.getppid() != zygote:
            os._exit(0)
        if seconds < 0:
            while True:
                signal.pause()
        time.sleep(seconds)
        os._exit(0)
    return pid

for _ in range(count):
    residents.add(fork(-1))
print("ready " + " ".join(map(str, sorted(residents))), flush=True)
for line in sys.stdin:
    word = line.split()
    if word and word[0] == "spawn":
        print(fork(float(word[1])), flush=True)
    elif word and word[0] == "quit":
        break
os._exit(0)
"""
)
"""One pod's processes (soak.py, violation_cost.py): ``python -S -c ZYGOTE RECORD DEVICE N``
opens DEVICE (a ``/dev/nvidia0`` look-alike) for all of them, forks N pausing children and
prints ``ready PID...``, then forks one short-lived child per ``spawn SECONDS`` line on its
stdin (answering its PID), and exits on ``quit`` or EOF (its children with it: keep its stdin
open). Every signal caught (``TIME signal PID NAME``; SIGTERM then ends the process that caught
it) and every abnormal or pausing child's exit (``TIME exit PID CODE``) is a line in RECORD."""


# ---------------------------------------------------------------------------------------------
# Metrics


def scrape(port: int, *, timeout: float = 5.0) -> str:
    """``GET /metrics`` of a process on 127.0.0.1 (raises ``OSError`` when it does not answer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text: str = r.read().decode()
        return text


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus exposition text as ``(sample name, labels, value)``, by prometheus_client's
    own parser (raises ``ValueError`` on a malformed exposition)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


# ---------------------------------------------------------------------------------------------
# Subprocesses


def gpuguard_argv(*args: str) -> list[str]:
    """The real gpuguard command line (``python -m gpuguard.cli``) with ``args``."""
    return [sys.executable, "-m", "gpuguard.cli", *args]


def gpuguard_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a gpuguard subprocess: no ``GPUGUARD_*``, ``NODE_NAME``
    or ``POD_UID`` (the host's settings must not reach it), this checkout first on
    ``PYTHONPATH`` (then whatever carried the dependencies: a GPU node without a venv), and
    ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPUGUARD_") and k not in ("NODE_NAME", "POD_UID")
    }
    parts = [str(REPO), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env | dict(extra or {})


def terminate(p: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> int | None:
    """SIGTERM the process the caller started (through its own ``Popen``, by its PID), SIGKILL
    after ``timeout``; reap it. Its exit status; ``None`` if it was never started. The one stop
    of a started subprocess for the benchmarks, the scripts and the tests (``rigs/controlplane.py``
    uses it)."""
    if p is None:
        return None
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


def pidfd_kill(pid: int) -> None:
    """SIGKILL ``pid`` through a pidfd (no PID-reuse race between finding the PID and the
    signal); a process already gone is fine. Only for a PID the caller started or found in a
    cgroup it created (``scripts/gpu_e2e.py``, ``rigs/cgroups.py``)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


@dataclass(slots=True, kw_only=True)
class Logged:
    """A process the benchmark starts (again, if it likes), its stdout and stderr appended to
    ``log``; stopped by its PID."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def check_running(self) -> None:
        """Raise ``RuntimeError`` with the log's tail if the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.popen.returncode}: {self.tail()}")

    def cpu_seconds(self) -> float:
        """Its CPU seconds and its waited-for children's (``nvidia-smi`` of a loop)."""
        seconds = cpu_seconds(self.pid, children=True)
        assert seconds is not None, f"{self.name} is gone"
        return seconds

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (its own PID), SIGKILL after ``timeout`` (:func:`terminate`); its exit
        status, ``None`` if it was never started."""
        return terminate(self.popen, timeout)

    def events(self, event: str) -> list[dict[str, Any]]:
        """Its JSON log lines whose ``event`` is ``event``."""
        return [doc for doc in read_jsonl(self.log) if doc.get("event") == event]


@dataclass(slots=True, kw_only=True)
class Gpuguard(Logged):
    """``gpuguard enforce`` or ``gpuguard agent`` serving its metrics on 127.0.0.1:``port``."""

    port: int

    def wait_ready(self, *, timeout: float = 60.0, metric: str | None = None) -> None:
        """Until ``/readyz`` answers 200, or with ``metric`` until ``/metrics`` carries that
        sample; ``RuntimeError`` if it exits first, ``TimeoutError`` after ``timeout``."""
        url = f"http://127.0.0.1:{self.port}/readyz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            with contextlib.suppress(OSError, ValueError):
                if metric is not None:
                    if any(name == metric for name, _, _ in self.metrics()):
                        return
                else:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if r.status == 200:
                            return
            time.sleep(0.1 if metric is None else 0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:g} s: {self.tail()}")

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Its ``/metrics``, parsed (``OSError``/``ValueError`` when it does not answer)."""
        return parse_metrics(scrape(self.port))
