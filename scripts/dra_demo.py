"""``make dra-demo``: DRA memory shares made real, on real parts, told in plain words (as root).

The real kube-apiserver, kube-controller-manager (ResourceClaim controller on) and
kube-scheduler v1.37.2, kwok as the kubelet of one GPU node whose two GPUs NVIDIA's DRA driver
publishes with consumable memory shares, two pods whose claim templates ask for 4Gi and 8Gi of
GPU 0, real processes in their containers' real cgroups listed by the NVML stand-in, and the
real ``gpuguard enforce --mode enforce`` with ``limits.sources = ["gpuguard", "dra"]``. It
prints the claims the controllers made, the shares the scheduler allocated, the pod over its
share stopped and the neighbour within its share untouched; exit 0 when that is what
happened, 1 otherwise, 2 when a prerequisite is missing. About 20 s once the binaries are
built. The same parts, with more cases, are ``tests/integration/test_dra.py``.

Why a script and not ``pytest -v``: the point is to be read, step by step, by someone who has
not seen the test; pytest prints only test names. Everything it runs is the test's helpers
(``rigs/dra_cluster.py``, ``rigs/node.py``).

Must not: signal a process it did not start (workers die with their cgroup tree, every
control-plane process and the enforcer by PID), or listen on anything but 127.0.0.1.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from _pytest.outcomes import OutcomeException

from rigs.cgroups import CgroupTree, kernel_problem
from rigs.controlplane import wait_until
from rigs.dra_cluster import (
    DraCluster,
    DraRig,
    start_dra_cluster,
)
from rigs.kubefixtures import ensure_namespace
from rigs.node import GIB, GPU_UUIDS
from rigs.nvml_stub import build_stub
from rigs.processes import gpu_device_node

REPO = Path(__file__).resolve().parents[1]

NAMESPACE = "team-a"
NODE = "gpu-node-1"
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {text}", flush=True)


def gib(n: int) -> str:
    return f"{n / GIB:g} GiB"


def run(dra: DraCluster, rig: DraRig) -> bool:
    (slice_,) = dra.node_slices(NODE)
    say(
        f"Node {NODE} (kwok) is Ready. NVIDIA's DRA driver published ResourceSlice "
        f"{slice_['metadata']['name']}:"
    )
    for d in slice_["spec"]["devices"]:
        policy = d["capacity"]["memory"]["requestPolicy"]["validRange"]
        say(
            f"  {d['name']}: uuid {d['attributes']['uuid']['string']}, memory "
            f"{d['capacity']['memory']['value']}, shares of {policy['min']} to {policy['max']} "
            f"in {policy['step']} steps, allowMultipleAllocations"
        )
    for tmpl, memory in (("train-4gi", "4Gi"), ("serve-8gi", "8Gi")):
        dra.add_template(NAMESPACE, tmpl, memory, gpu=0)
        say(f"ResourceClaimTemplate {tmpl}: one gpu.nvidia.com device, capacity memory {memory}")
    pods = {}
    for pod, tmpl in (("trainer", "train-4gi"), ("server", "serve-8gi")):
        dra.add_pod(NAMESPACE, pod, node=NODE, template=tmpl)
        pods[pod] = dra.running_pod(NAMESPACE, pod)
        (share,) = dra.shares(NAMESPACE, pod)
        say(
            f"Pod {pod}: the controller-manager made claim {share.claim}; the scheduler "
            f"allocated {share.memory} of {share.device} ({GPU_UUIDS[share.gpu]}), shareID "
            f"{share.share_id}; kwok runs it."
        )
    trainer = rig.spawn(pods["trainer"], "trainer", used_bytes=6 * GIB, gpu=0)
    server = rig.spawn(pods["server"], "server", used_bytes=7 * GIB, gpu=0)
    for w, memory in ((trainer, "4Gi"), (server, "8Gi")):
        say(
            f"  {w.name}'s process (PID {w.pid}, in its container's cgroup) uses "
            f"{gib(w.used_bytes)} of GPU 0; its share is {memory}."
        )
    say("Starting gpuguard enforce --mode enforce, limits.sources = [gpuguard, dra] ...")
    enforcer = rig.start_enforcer(sources=("gpuguard", "dra"))
    wait_until(lambda: not trainer.alive(), timeout=30, what="trainer to be stopped")
    (line,) = enforcer.settled_events("container_signalled", 1)
    say(
        f"gpuguard sent {line['signal']} to pod {line['pod']} (container {line['container']}, "
        f"PIDs {line['pids']}): {gib(trainer.used_bytes)} on GPU {line['gpu']}, over its DRA "
        f"share of {gib(int(line['limit_bytes']))}. The process got {trainer.received()} and "
        f"exited ({trainer.proc.returncode})."
    )
    time.sleep(2.0)
    labels = {"namespace": NAMESPACE, "pod": "server", "gpu": "0"}
    limit = enforcer.metric("gpuguard_pod_gpu_memory_limit_bytes", labels)
    calm = server.alive() and server.received() == []
    say(
        f"Pod server on the same GPU: {gib(server.used_bytes)}, within its share (gpuguard's "
        f"limit for it: {gib(int(limit)) if limit is not None else 'none'}): "
        + (
            "untouched, still running, no signal."
            if calm
            else f"NOT untouched: {server.received()}"
        )
    )
    wrong = [e for e in enforcer.events("container_signalled") if e["pod"] != "trainer"]
    ok = calm and not wrong and limit == 8 * GIB and not trainer.alive()
    say("Result: " + ("as promised." if ok else f"NOT as promised (wrong signals: {wrong})."))
    return ok


def main() -> int:
    if os.geteuid() != 0:
        print("make dra-demo needs root (real cgroups, a mknod'ed /dev/nvidia0 look-alike)")
        return 2
    problem = kernel_problem(((2, ""),))
    if problem:
        print(f"make dra-demo needs a writable cgroup v2 hierarchy: {problem}")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuguard-dra-demo-") as tmp:
        work = Path(tmp)
        say(
            "Starting the real control plane: etcd, kube-apiserver, kube-controller-manager "
            "(with resourceclaim-controller), kube-scheduler v1.37.2, kwok ..."
        )
        try:
            stub = build_stub()
            dra = start_dra_cluster(work / "cluster")
        except OutcomeException as e:
            print(f"missing prerequisite: {e}")
            return 2
        tree = CgroupTree()
        rig: DraRig | None = None
        ok = False
        try:
            dra.add_gpu_node(NODE)
            ensure_namespace(dra.cluster, NAMESPACE)
            rig = DraRig(
                cluster=dra.cluster,
                namespace=NAMESPACE,
                node=NODE,
                tree=tree,
                workdir=work,
                stub_lib=stub,
                device_node=gpu_device_node(work / "nvidia0"),
                kubeconfig=dra.kubeconfig,
            )
            ok = run(dra, rig)
        except OutcomeException as e:
            say(f"failed: {e}")
            ok = False
        finally:
            if rig is not None:
                for enforcer in rig.enforcers:
                    enforcer.stop()
                    if not ok:
                        print(f"--- the enforcer's log, last lines:\n{enforcer.text()[-4000:]}")
                rig.enforcers.clear()
                rig.close()
            tree.close()
            dra.close()
        say("Done: every process it started is stopped.")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
