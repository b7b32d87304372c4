"""``make cluster`` as a new admin uses it: ``python -m scripts.cluster up`` starts the local
cluster in the background and prints commands; those commands, run as printed, install the chart
and the greedy demo (examples/greedy-demo); the greedy pod is stopped and its neighbour is not;
``down`` stops it all and leaves nothing behind.

What is real: everything of tests/node/test_real_node.py's world (rigs/kubelet/cluster.py is the
same code) plus the script itself, its background process and its state files. What stands in:
the GPU (NVML lists the pods' processes that hold ``/dev/nvidia0`` with the memory their
``GPUGUARD_DEMO_GPU_MEMORY`` says, ``rigs.kubelet.cluster.StandinGpu``). The image is the one
this session built (``--image-archive``): ``up`` builds it the same way otherwise (the
``rigs.kubelet.images.build`` the other node tests run).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigs.controlplane import wait_until
from rigs.kubelet.cluster import NODE, REPLICAS, Binaries
from rigs.kubelet.node import Marker, host_snapshot, marker_path, node_leftovers
from rigs.prereq import require

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.node]

REPO = Path(__file__).resolve().parents[2]


def cluster(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.cluster", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def printed_commands(text: str, program: str) -> list[str]:
    """The ``program …`` command lines of the printed instructions, ``\\`` continuations joined,
    comments dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [
        line.split("#", 1)[0].strip()
        for line in joined.splitlines()
        if line.strip().startswith(f"{program} ")
    ]


class Shell:
    """Runs printed lines in bash with the printed ``export`` lines applied, as a terminal
    would; HOME is a folder of the test (helm's caches)."""

    def __init__(self, exports: list[str], home: Path) -> None:
        self.prelude = "\n".join(exports)
        self.home = home

    def run(self, line: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euc", f"{self.prelude}\n{line}"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={"PATH": "/usr/bin:/bin", "HOME": str(self.home)},
        )

    def api(self, path: str) -> dict[str, Any]:
        """GET ``path`` with the printed kubeconfig's credentials (what kubectl would show)."""
        code = (
            "import json, sys, yaml, base64, ssl, tempfile, os, urllib.request\n"
            "kc = yaml.safe_load(open(os.environ['KUBECONFIG']))\n"
            "c, u = kc['clusters'][0]['cluster'], kc['users'][0]['user']\n"
            "d = tempfile.mkdtemp()\n"
            "def w(n, v):\n"
            "    p = os.path.join(d, n); open(p, 'wb').write(base64.b64decode(v)); return p\n"
            "ctx = ssl.create_default_context(cafile=w('ca', c['certificate-authority-data']))\n"
            "ctx.load_cert_chain(w('crt', u['client-certificate-data']), "
            "w('key', u['client-key-data']))\n"
            "got = urllib.request.urlopen(c['server'] + sys.argv[1], context=ctx)\n"
            "print(got.read().decode())\n"
        )
        done = self.run(f"{sys.executable} -c {_quote(code)} {_quote(path)}", timeout=30)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    bins, why = Binaries.find()
    require(bins is not None, why)
    assert bins is not None
    return bins


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A short directory: the node's Unix sockets live below it (pytest's tmp_path is too long,
    which ``up`` refuses, as the next test shows)."""
    directory = Path(tempfile.mkdtemp(prefix="gpuguard-cluster-", dir="/tmp")) / "c"
    yield directory
    if (directory / "state.json").exists():  # a failed test: stop it anyway
        cluster("down", "--dir", str(directory))
    shutil.rmtree(directory.parent, ignore_errors=True)


def test_make_cluster_runs_the_chart_and_the_demo_then_leaves_nothing(
    binaries: Binaries, state_dir: Path, tmp_path: Path
) -> None:
    before = host_snapshot()
    up = cluster(
        "up", "--dir", str(state_dir), "--image-archive", str(binaries.images.gpuguard_archive)
    )
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_log(state_dir)}"
    exports = [line.strip().split("#", 1)[0] for line in up.stdout.splitlines()
               if line.strip().startswith("export ")]  # fmt: skip
    assert [e.split("=", 1)[0] for e in exports] == ["export KUBECONFIG", "export PATH"]
    shell = Shell(exports, tmp_path / "home")
    state = json.loads((state_dir / "state.json").read_text())
    marker = Marker.load(marker_path(state_dir / "run" / "node"))

    # What the printed text promises: a Ready node with its GPU replicas, kept Ready by the
    # kubelet's own Lease, and the nvidia RuntimeClass.
    node = shell.api(f"/api/v1/nodes/{NODE}")
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(REPLICAS)
    lease = shell.api(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}")
    first_renewal = lease["spec"]["renewTime"]
    assert shell.api("/apis/node.k8s.io/v1/runtimeclasses/nvidia")["handler"] == "nvidia"

    # Run twice, it says it runs already and starts nothing.
    again = cluster("up", "--dir", str(state_dir))
    assert again.returncode == 0, again.stdout
    assert "runs already" in again.stdout
    assert json.loads((state_dir / "state.json").read_text())["pid"] == state["pid"]
    assert f"PID {state['pid']}" in cluster("status", "--dir", str(state_dir)).stdout

    install, demo = printed_commands(up.stdout, "helm")
    done = shell.run(install)
    assert done.returncode == 0, f"{install}\n{done.stdout}{done.stderr}\n{_log(state_dir)}"
    done = shell.run(demo)
    assert done.returncode == 0, f"{demo}\n{done.stdout}{done.stderr}"

    def pod(name: str) -> dict[str, Any]:
        return shell.api(f"/api/v1/namespaces/demo/pods/{name}")

    def terminated(name: str) -> dict[str, Any]:
        statuses = pod(name)["status"].get("containerStatuses") or [{}]
        return dict(statuses[0].get("state", {}).get("terminated") or {})

    wait_until(lambda: terminated("greedy"), timeout=120, what="the greedy pod stopped")
    assert terminated("greedy")["exitCode"] == 137, terminated("greedy")
    events = shell.api("/api/v1/namespaces/demo/events")["items"]
    reasons = {(e["involvedObject"]["name"], e["reason"]) for e in events}
    assert {("greedy", "GPUMemoryLimitExceeded"), ("greedy", "GPUProcessKilled")} <= reasons
    assert not {r for n, r in reasons if n == "neighbour"} & {
        "GPUMemoryLimitExceeded",
        "GPUProcessKilled",
    }
    neighbour = pod("neighbour")["status"]
    assert neighbour["phase"] == "Running"
    assert neighbour["containerStatuses"][0]["restartCount"] == 0
    renewed = shell.api(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}")
    assert renewed["spec"]["renewTime"] != first_renewal, "the kubelet renews its Lease"

    down = cluster("down", "--dir", str(state_dir), timeout=400)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}"
    assert not state_dir.exists()
    assert (
        not Path(f"/proc/{state['pid']}").exists()
        or _start_time(state["pid"]) != state["start_time"]
    )
    assert node_leftovers(marker) == []
    assert sorted(host_snapshot() - before) == []
    again = cluster("down", "--dir", str(state_dir))
    assert again.returncode == 0
    assert "nothing to do" in again.stdout


def test_a_directory_too_long_for_the_nodes_sockets_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    directory = tmp_path / ("d" * 80)
    done = cluster("up", "--dir", str(directory), timeout=60)
    assert done.returncode == 2, done
    assert "too long" in done.stdout
    assert "/tmp/gpuguard-cluster" in done.stdout
    assert not directory.exists()


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _log(state_dir: Path) -> str:
    log = state_dir / "cluster.log"
    return log.read_text(errors="replace")[-6000:] if log.exists() else ""
