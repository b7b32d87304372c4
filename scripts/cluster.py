"""``make cluster`` / ``make cluster-down``: a local cluster to try the chart on (as root).

One control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2 on
127.0.0.1) and one real node, ``gpu-node-1``: kubelet v1.37.2, containerd v2.4.2 and runc in a
network namespace of its own, with a stand-in GPU (the C NVML stand-in, reached through an
``nvidia`` runtime handler like NVIDIA's; a device plugin advertising 4 ``nvidia.com/gpu``
replicas; the ``nvidia`` RuntimeClass; the labels GPU feature discovery sets), the gpuguard
image ``make image`` builds already imported, and a values file that points the chart at it.
The same parts the real-node tests run (rigs/kubelet/cluster.py, docs/real-node.md).

The GPU is a stand-in: a process in a pod on this node that opens ``/dev/nvidia0`` and carries
``GPUGUARD_DEMO_GPU_MEMORY=<quantity>`` in its environment is listed by NVML as holding that
much (examples/greedy-demo does so). Everything else is real.

Commands (``--dir`` defaults to /tmp/gpuguard-cluster; one cluster per machine):

  up      build what is missing (the first run takes minutes; cached under ~/.cache), start the
          cluster in the background, print the kubeconfig and the commands to try it, return
  down    stop it and remove everything it made (processes, mounts, cgroups, its network
          namespace, the directory); says what, if anything, could not be removed
  status  whether it runs, and its kubeconfig
  serve   the cluster in the foreground (what ``up`` starts); Ctrl-C or SIGTERM stops it

Exit status: 0 done; 1 the cluster failed (the log says why) or left something behind; 2 bad
usage or a missing prerequisite (the message names the command that provides it).

Must not: signal a process it did not start (``down`` signals only the ``serve`` process whose
PID, start time and command line it recorded); listen on anything but 127.0.0.1 and addresses
inside the node's own network namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rigs.kubelet import cluster as local_cluster
from rigs.kubelet.node import mounts_under, reap_leftovers, signal_verified

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path("/tmp/gpuguard-cluster")
STATE = "state.json"
"""Written by ``serve`` once the cluster is ready: its PID and start time, the kubeconfig."""
STOPPED = "stopped.json"
"""Written by ``serve`` as it ends: what could not be removed (empty: nothing)."""
LOG = "cluster.log"
RUN = "run"
"""The cluster's work directory below ``--dir``: etcd's data, containerd's root, the kubelet's."""
RELEASE_NAMESPACE = "gpuguard"
DEMO_NAMESPACE = "demo"
SOCKET_PATH_MAX = 107
"""The longest Unix socket path bind(2) takes (``sun_path`` is 108 bytes with its NUL)."""
LONGEST_SOCKET = f"{RUN}/node/kubelet/pod-resources/1234567890"
"""The deepest socket below ``--dir``: the kubelet's pod-resources listener, bound through a
temporary name of up to 10 digits beside its final one."""
EXIT_FAILED = 1
EXIT_USAGE = 2


def say(text: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _load(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


def remove_tree(path: Path) -> list[str]:
    """Remove ``path`` unless something is still mounted below it (a container's root file
    system with its host mounts: removing through it could reach the host); what stops it."""
    if not path.exists():
        return []
    mounted = mounts_under([path])
    if mounted:
        return [f"{path}: still mounted below it: {', '.join(map(str, mounted[:5]))}"]
    shutil.rmtree(path, ignore_errors=True)
    return [f"{path} could not be removed"] if path.exists() else []


def running(state: dict[str, Any] | None) -> bool:
    """The ``serve`` process ``state`` names is still that process (PID and start time)."""
    if not state:
        return False
    pid, started = state.get("pid"), state.get("start_time")
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == started


# ---------------------------------------------------------------------------------------------
# serve: the cluster in the foreground


def values_for(local: local_cluster.LocalCluster) -> dict[str, Any]:
    """The chart's values for this cluster: the image already on the node (never pulled), the
    kubelet's pod-resources directory (below the node's work directory, not /var/lib/kubelet),
    enforce mode with a short grace period so the demo is quick to watch."""
    repository, _, tag = local.binaries.images.gpuguard_ref.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "kubelet": {"podResourcesDir": str(local.node.kubelet_root / "pod-resources")},
        "enforcement": {"mode": "enforce"},
        "config": {"enforcement": {"grace_seconds": 2}},
    }


def instructions(directory: Path, state: dict[str, Any]) -> str:
    kubeconfig = state["kubeconfig"]
    values = state["values"]
    helm_dir = Path(state["helm"]).parent
    return f"""
The local cluster is up: node {local_cluster.NODE} (a real kubelet and containerd; its GPU is
the NVML stand-in, {local_cluster.GPU_NAME}, {local_cluster.REPLICAS} nvidia.com/gpu replicas).

  export KUBECONFIG={kubeconfig}
  export PATH={helm_dir}:$PATH   # helm; kubectl is your own (1.36 to 1.38)

Install gpuguard from this clone (its image is on the node already; {values} points the
chart at it, in enforce mode with a 2 s grace period):

  helm upgrade --install gpuguard {REPO}/helm/gpuguard -n {RELEASE_NAMESPACE} \\
    --create-namespace -f {values} --wait

Then a greedy pod (holds 3Gi, limit 1Gi) and its neighbour (2Gi, limit 4Gi):

  helm install greedy-demo {REPO}/examples/greedy-demo -n {DEMO_NAMESPACE} --create-namespace

  kubectl get pods -n {DEMO_NAMESPACE} -w          # greedy: Error (stopped), neighbour: Running
  kubectl get events -n {DEMO_NAMESPACE}           # GPUMemoryLimitExceeded, GPUProcessKilled

Stop it and remove everything: make cluster-down
(or: python -m scripts.cluster down --dir {directory})
"""


def serve(directory: Path, image_archive: Path | None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        say(f"{signal.Signals(signum).name}: stopping")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STOPPED).unlink(missing_ok=True)
    problems: list[str] = []
    status = 0
    try:
        with contextlib.ExitStack() as stack:
            status = _serve(stack, directory, image_archive, stop)
    except Exception as e:  # noqa: BLE001 (every part is stopped by now: say what failed)
        say(f"failed: {e}")
        problems.append(f"{type(e).__name__}: {e}")
        status = EXIT_FAILED
    if not problems:
        problems = remove_tree(directory / RUN)
    (directory / STATE).unlink(missing_ok=True)
    _write_json(directory / STOPPED, {"status": status, "problems": problems})
    say("stopped, nothing left behind" if not problems else f"stopped; left: {problems}")
    return status if not problems else EXIT_FAILED


def _serve(
    stack: contextlib.ExitStack, directory: Path, image_archive: Path | None, stop: threading.Event
) -> int:
    bins, why = local_cluster.Binaries.find(
        lambda what: say(f"building or finding {what}"), image_archive=image_archive
    )
    if bins is None:
        say(f"missing prerequisite: {why}")
        return EXIT_USAGE
    if stop.is_set():
        return 0
    local = local_cluster.start(
        stack, directory / RUN, bins, progress=lambda w: say(f"starting {w}")
    )
    standin = local_cluster.StandinGpu(local)
    standin.start()
    stack.callback(standin.close)
    values = directory / "values.yaml"
    values.write_text(
        "# The chart's values for the local cluster (python -m scripts.cluster).\n"
        + yaml.safe_dump(values_for(local), sort_keys=False)
    )
    state = {
        "pid": os.getpid(),
        "start_time": _start_time(os.getpid()),
        "kubeconfig": str(local.cluster.admin_kubeconfig),
        "values": str(values),
        "helm": str(bins.helm),
        "node": local_cluster.NODE,
        "image": bins.images.gpuguard_ref,
    }
    _write_json(directory / STATE, state)
    say("ready")
    print(instructions(directory, state), flush=True)
    while not stop.wait(1.0):
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# up, down, status


def up(directory: Path, image_archive: Path | None, timeout: float) -> int:
    state = _load(directory / STATE)
    if running(state):
        say(f"a local cluster runs already (PID {state and state['pid']}); make cluster-down first")
        print(instructions(directory, state or {}), flush=True)
        return 0
    if os.geteuid() != 0:
        say("a real node needs root (kubelet, containerd, runc): run as root")
        return EXIT_USAGE
    directory.mkdir(parents=True, exist_ok=True)
    for stale in (STATE, STOPPED):
        (directory / stale).unlink(missing_ok=True)
    log = directory / LOG
    argv = [sys.executable, "-m", "scripts.cluster", "serve", "--dir", str(directory)]
    if image_archive is not None:
        argv += ["--image-archive", str(image_archive)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this command and the terminal
        )
    say(f"starting in the background (PID {proc.pid}, log {log}); the first run builds for minutes")
    deadline = time.monotonic() + timeout
    shown = 0
    while True:
        text = log.read_text(errors="replace")
        for line in text.splitlines()[shown:]:
            if line.startswith("[cluster "):
                print(line, flush=True)
        shown = len(text.splitlines())
        state = _load(directory / STATE)
        if state is not None and state.get("pid") == proc.pid:
            print(instructions(directory, state), flush=True)
            return 0
        if proc.poll() is not None:
            say(f"the cluster did not start (exit {proc.returncode}); the end of {log}:")
            print("\n".join(text.splitlines()[-40:]), flush=True)
            return EXIT_USAGE if proc.returncode == EXIT_USAGE else EXIT_FAILED
        if time.monotonic() > deadline:
            say(f"not ready after {timeout:.0f} s: stopping it")
            proc.terminate()
            proc.wait(timeout=300)
            return EXIT_FAILED
        time.sleep(1.0)


def down(directory: Path, timeout: float) -> int:
    state = _load(directory / STATE)
    if running(state):
        assert state is not None
        pid = int(state["pid"])
        say(f"stopping the cluster (PID {pid})")
        signal_verified(pid, lambda p: _start_time(p) == state["start_time"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while running(state) and time.monotonic() < deadline:
            time.sleep(0.5)
        if running(state):
            say(f"PID {pid} still runs after {timeout:.0f} s; see {directory / LOG}")
            return EXIT_FAILED
    elif not directory.exists():
        say(f"no local cluster in {directory}: nothing to do")
        return 0
    stopped = _load(directory / STOPPED)
    problems = list(stopped.get("problems", [])) if stopped else []
    if stopped is None:  # it crashed, or was killed: remove what a node leaves behind
        problems = reap_leftovers() or remove_tree(directory / RUN)
    if problems:
        say(f"could not remove everything; kept {directory} (log {directory / LOG}):")
        for problem in problems:
            print(f"  {problem}", flush=True)
        return EXIT_FAILED
    problems = remove_tree(directory)
    say(f"stopped; removed {directory}" if not problems else problems[0])
    return 0 if not problems else EXIT_FAILED


def status(directory: Path) -> int:
    state = _load(directory / STATE)
    if running(state):
        assert state is not None
        say(f"running (PID {state['pid']}): export KUBECONFIG={state['kubeconfig']}")
        return 0
    say(f"no local cluster runs in {directory}")
    return EXIT_FAILED


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.cluster",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog=(
            "make cluster runs `up`, make cluster-down runs `down` (CLUSTER_DIR=<dir> for "
            "another directory). docs/install.md, 'Try it locally', walks through it."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_ in (
        ("up", "start it in the background and print how to use it"),
        ("serve", "run it in the foreground until Ctrl-C or SIGTERM"),
        ("down", "stop it and remove everything it made"),
        ("status", "whether it runs, and its kubeconfig"),
    ):
        c = sub.add_parser(name, help=help_, description=help_)
        c.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_DIR,
            metavar="DIR",
            help=f"its state, log and work directory (default {DEFAULT_DIR})",
        )
        if name in ("up", "serve"):
            c.add_argument(
                "--image-archive",
                type=Path,
                metavar="FILE",
                help="the gpuguard image to import (an OCI archive, e.g. make image's "
                "build/gpuguard-image.oci.tar) instead of building one",
            )
        if name in ("up", "down"):
            c.add_argument(
                "--timeout",
                type=float,
                default=3600.0 if name == "up" else 300.0,
                metavar="SECONDS",
                help="how long to wait (default: %(default)s)",
            )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    directory = args.dir.absolute()
    room = SOCKET_PATH_MAX - len(LONGEST_SOCKET) - 1
    if args.command in ("up", "serve") and len(str(directory)) > room:
        say(
            f"--dir {directory}: too long ({len(str(directory))} characters) for the node's Unix "
            f"sockets below it; choose one of at most {room} (default {DEFAULT_DIR})"
        )
        return EXIT_USAGE
    archive = getattr(args, "image_archive", None)
    if archive is not None and not archive.is_file():
        say(f"--image-archive {archive}: no such file (make image writes one under build/)")
        return EXIT_USAGE
    if archive is not None:
        archive = archive.absolute()
    if args.command == "serve":
        return serve(directory, archive)
    if args.command == "up":
        return up(directory, archive, args.timeout)
    if args.command == "down":
        return down(directory, args.timeout)
    return status(directory)


if __name__ == "__main__":
    sys.exit(main())
