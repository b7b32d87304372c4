"""Forced PID reuse against the resolver's pins: a PID the enforcer pinned (its pidfd kept open,
``ProcfsProcessResolver(pin_processes=True)``) and that a process in another pod then takes is
attributed to that other pod, never to the pod of the process that held it (the memory NVML
lists under the PID would be charged to the wrong pod, and that pod stopped).

Like ``test_pid_reuse``, the proof runs in a fresh PID namespace (``unshare --pid --fork
--mount-proc``), where the driver writes ``/proc/sys/kernel/ns_last_pid`` to hand the pinned
process's exact PID to the next one. Per trial: start V in pod V's container cgroup, wait a
clock tick (GPU processes are observed over seconds, so their successor never shares their
start tick), attribute it (pinned); ask again (the pin answers); SIGKILL and reap V; start R with
V's PID in pod R's container (variant ``other``) or V's own (``same``); attribute the PID again:
R's identity and R's pod, and R pinned in V's place. Also as a driver: ``python -m
tests.kernel.test_pin_reuse --trials N``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from gpuguard.adapters.procfs import ProcfsProcessResolver, read_identity
from gpuguard.core.model import ContainerCgroup
from rigs.cgroups import CgroupTree
from rigs.pid_reuse import (
    POD_R,
    POD_V,
    SLEEP,
    require_unshare,
    run_driver_in_new_pid_namespace,
    start_on_its_pid,
    victim_and_rival_containers,
    wait_past_start_tick,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    variant: str
    reused: bool
    """R got exactly V's PID."""
    v_pod: str | None
    v_pinned: bool
    """V was pinned after its first attribution, and the second came from the pin."""
    r_pod: str | None
    r_identity_is_r: bool
    r_pinned: bool
    wrong_pod: bool


def _one_trial(
    tree: CgroupTree,
    resolver: ProcfsProcessResolver,
    variant: str,
    cgs: dict[str, ContainerCgroup],
) -> Trial:
    v = tree.spawn(SLEEP, cgroups=[cgs["v"]])
    identity = read_identity(Path("/proc"), v.pid)
    assert identity is not None
    wait_past_start_tick(identity)
    first = resolver.attribute(v.pid)
    again = resolver.attribute(v.pid)
    v_pinned = resolver.pinned == 1 and again is first
    r = start_on_its_pid(tree, v, cgs["v" if variant == "same" else "r"])
    try:
        reused = r.pid == v.pid
        r_identity = read_identity(Path("/proc"), r.pid)
        got = resolver.attribute(r.pid)
        expected_pod = POD_V if variant == "same" else POD_R
        trial = Trial(
            variant=variant,
            reused=reused,
            v_pod=first.pod_uid,
            v_pinned=v_pinned,
            r_pod=got.pod_uid,
            r_identity_is_r=got.identity == r_identity,
            r_pinned=resolver.pinned == 1,
            wrong_pod=got.pod_uid != expected_pod or got.identity != r_identity,
        )
    finally:
        r.kill()
        r.wait()
    resolver.attribute(r.pid)  # gone: unpinned
    return trial


def drive(*, trials: int, variants: list[str], tree_name: str) -> dict[str, object]:
    resolver = ProcfsProcessResolver(Path("/proc"), pin_processes=True)
    results: list[Trial] = []
    with CgroupTree(name=tree_name) as tree:
        cgs = dict(zip(("v", "r"), victim_and_rival_containers(tree), strict=True))
        for n in range(trials):
            results.append(_one_trial(tree, resolver, variants[n % len(variants)], cgs))
    left_pinned = resolver.pinned
    resolver.close()
    return {
        "trials": len(results),
        "reuse_achieved": sum(t.reused for t in results),
        "v_pinned": sum(t.v_pinned for t in results),
        "r_pinned": sum(t.r_pinned for t in results),
        "wrong_pods": sum(t.wrong_pod for t in results),
        "left_pinned": left_pinned,
        "in_new_pid_namespace": os.getpid() == 1,
        "results": [asdict(t) for t in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--variants", default="other,same")
    parser.add_argument("--tree-name", required=True)
    args = parser.parse_args(argv)
    summary = drive(trials=args.trials, variants=args.variants.split(","), tree_name=args.tree_name)
    print(json.dumps(summary))
    return 0


@pytest.mark.kernel
def test_a_pinned_pid_taken_by_another_pods_process_is_attributed_to_that_pod() -> None:
    require_unshare()
    summary = run_driver_in_new_pid_namespace(
        "tests.kernel.test_pin_reuse", "pins", "--trials", "40", timeout=120
    )
    assert summary["in_new_pid_namespace"] is True
    assert summary["trials"] == 40
    assert summary["reuse_achieved"] == 40, "ns_last_pid did not force reuse: proof is vacuous"
    assert summary["wrong_pods"] == 0, [t for t in summary["results"] if t["wrong_pod"]]
    assert summary["v_pinned"] == 40, "the first process was not pinned: nothing was tested"
    assert summary["r_pinned"] == 40
    assert summary["left_pinned"] == 0


if __name__ == "__main__":
    raise SystemExit(main())
