"""``scripts/gpu_e2e.py --dra`` without a GPU: everything of a DRA trial but the CUDA workers.

The script's own ``ApiServer`` starts the real etcd and kube-apiserver v1.37.2 from
xz-compressed copies (``<name>.xz`` in ``TESTBIN_DIR``, as a GPU machine gets them from
``scripts/pack-apiserver.sh``), with no controller-manager or scheduler, as on the GPU machine.
Its ``DraDriver`` reads the GPU's UUID through ``pynvml`` (here from the NVML stand-in, loaded
into this process), publishes the DeviceClass and the ResourceSlice, and plays the scheduler for
a greedy and a modest pod (claims allocated as admin through the status subresource). The real
``gpuguard enforce`` with ``limits.sources = ["gpuguard", "dra"]`` reads them as the chart's
ServiceAccount; the script's ``wait_for_limit`` (what a DRA trial waits for before its worker
grows) must see the share as the greedy pod's limit on /metrics; the greedy pod's process over
its share is stopped, the modest one within its share never signalled; ``remove`` deletes pods
and claims. Then ``gpu_e2e.main`` itself, on the stand-in with CUDA-free workers
(``e2e_standin_worker.py``, whose usage a test thread lists as the driver would): a short
``--dra`` run, and a pods-file run (the modes ``--dra`` must leave as they were). The CUDA
side (PyTorch's allocations, the real driver's timings) runs only on a GPU (docs/gpu-e2e.md).
"""

from __future__ import annotations

import ctypes
import json
import lzma
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuguard.kubemodel.quantity import parse_quantity_bytes
from rigs.cgroups import CgroupTree, kernel_problem
from rigs.controlplane import AdminRequestError, find_binaries, wait_until
from rigs.node import GIB, GPU_TOTAL_BYTES, GPU_UUID, PodInfo, Rig
from rigs.nvml_stub import SCENARIO_ENV
from rigs.prereq import require
from tests.integration.e2e_standin import run_on_standin
from tests.scripts_loader import load_script

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

REPO = Path(__file__).resolve().parents[2]
SHARE = 4 * GIB


@pytest.fixture(scope="module")
def packed_testbin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """etcd.xz and kube-apiserver.xz only (the fastest xz preset: the format is what counts)."""
    binaries, why = find_binaries()
    require(why is None, why or "")
    d = tmp_path_factory.mktemp("packed")
    for name, path in binaries.items():
        with path.open("rb") as fin, lzma.open(d / f"{name}.xz", "wb", preset=0) as fout:
            shutil.copyfileobj(fin, fout)
    return d


@pytest.fixture
def e2e() -> Iterator[ModuleType]:
    yield load_script("gpu_e2e")
    sys.modules.pop("gpu_e2e", None)


def test_dra_trial_objects_hold_the_greedy_pod_to_its_share_and_leave_the_modest_one(
    e2e: ModuleType,
    packed_testbin: Path,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    monkeypatch.setenv("TESTBIN_DIR", str(packed_testbin))
    api = e2e.ApiServer(tmp_path / "kube", "gpuguard")
    tree = CgroupTree()
    rig: Rig | None = None
    nvml: Any = None
    try:
        # Decompressed into the run's own directory, not beside the packed files.
        assert sorted(p.name for p in packed_testbin.iterdir()) == [
            "etcd.xz",
            "kube-apiserver.xz",
        ]
        rig = Rig(
            cluster=api.cluster, namespace=e2e.NAMESPACE, node=e2e.NODE, tree=tree,
            workdir=tmp_path, stub_lib=stub_lib, device_node=device_node,
            kubeconfig=lambda: api.kubeconfig,
        )  # fmt: skip
        # pynvml in this process finds the stand-in already loaded (glibc matches by SONAME).
        ctypes.CDLL(str(stub_lib), mode=ctypes.RTLD_GLOBAL)
        monkeypatch.setenv(SCENARIO_ENV, str(rig.scenario.path))
        nvml = e2e.Nvml(0)
        dra = e2e.DraDriver(api, nvml)
        assert dra.gpu_uuid == GPU_UUID
        (device,) = dra.slice["spec"]["devices"]
        assert device["attributes"]["uuid"] == {"string": GPU_UUID}
        # The API server writes quantities canonically (81920Mi comes back as 80Gi).
        assert parse_quantity_bytes(device["capacity"]["memory"]["value"]) == GPU_TOTAL_BYTES

        greedy, modest = dra.add_pod("dra-greedy-0", SHARE), dra.add_pod("dra-modest-0", SHARE)
        api.publish([greedy, modest])
        claim = api.cluster.admin_request(
            "GET", f"/apis/resource.k8s.io/v1/namespaces/e2e/resourceclaims/{greedy.name}-gpu"
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (e2e.NODE, dra.device)
        assert result["consumedCapacity"] == {"memory": "4Gi"}
        assert result["shareID"]
        assert claim["status"]["reservedFor"][0]["uid"] == greedy.uid
        pod = api.cluster.admin_request("GET", f"/api/v1/namespaces/e2e/pods/{greedy.name}")
        assert not pod["metadata"].get("annotations"), "the share must be the only limit"

        def info(p: Any) -> PodInfo:
            return PodInfo(namespace="e2e", name=p.name, uid=p.uid, container_id=p.container_id)

        hog = rig.spawn(info(greedy), "greedy", used_bytes=1 * GIB)
        calm = rig.spawn(info(modest), "modest", used_bytes=2 * GIB)
        enforcer = rig.start_enforcer(kubeconfig=api.kubeconfig, sources=("gpuguard", "dra"))
        seen = e2e.wait_for_limit(enforcer.metrics_port, greedy.name, SHARE, 30.0)
        assert seen, enforcer.text()[-4000:]
        assert e2e.scraped_limit(enforcer.metrics_port, modest.name) == SHARE

        rig.set_usage(hog, SHARE + 2 * GIB)
        wait_until(lambda: not hog.alive(), timeout=20, what="the greedy pod's process stopped")
        assert hog.received() == ["SIGTERM"]
        assert calm.alive()
        assert calm.received() == []
        # The process can die before the enforcer writes the line saying it signalled it.
        signalled = {e.get("pod") for e in enforcer.settled_events("container_signalled", 1)}
        assert signalled == {greedy.name}
        assert all(e2e.may_be_signalled(p) for p in signalled)
        assert not e2e.may_be_signalled(modest.name)

        for p in (greedy, modest):
            dra.remove(p)
            dra.remove(p)  # gone already is fine
            with pytest.raises(AdminRequestError) as gone:
                api.cluster.admin_request(
                    "GET", f"/apis/resource.k8s.io/v1/namespaces/e2e/resourceclaims/{p.name}-gpu"
                )
            assert gone.value.code == 404
    finally:
        try:
            if rig is not None:
                rig.close()
        finally:
            if nvml is not None:
                nvml.close()
            tree.close()
            api.close()


def test_dra_needs_an_api_server_and_adds_dra_to_the_limit_sources(e2e: ModuleType) -> None:
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--dra", "--out", "/nonexistent"])
    assert exit_.value.code == 2  # argparse's usage error, before anything is built
    parser_args = type("Args", (), {"limit_source": "hami", "dra": True, "container_trials": 0})()
    assert e2e.limit_sources(parser_args) == ["gpuguard", "hami", "dra"]
    parser_args.dra = False
    assert e2e.limit_sources(parser_args) == ["gpuguard", "hami"]
    parser_args.container_trials = 2  # the two-containers pod's own limit is KAI's key
    assert e2e.limit_sources(parser_args) == ["gpuguard", "hami", "kai"]


def test_a_short_dra_run_of_the_script_on_the_stand_in_stops_each_greedy_pod_and_no_other(
    e2e: ModuleType,
    packed_testbin: Path,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``gpu_e2e.main --dra`` itself, its workers replaced by CUDA-free ones: three DRA trials
    (two greedy, one stubborn: the SIGKILL path) beside a modest pod each, the neighbour and the
    host process, judged by the script (exit 0) and read back from its results.json."""
    monkeypatch.setenv("TESTBIN_DIR", str(packed_testbin))
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "0", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--apiserver", str(tmp_path / "kube"), "--dra",
         "--dra-trials", "2", "--dra-stubborn-trials", "1", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["wrong_kills"] == []
    assert result["dra"]["gpu_uuid"] == GPU_UUID
    assert result["summary"]["dra-greedy"]["ok"] == 2
    assert result["summary"]["dra-stubborn"]["ok"] == 1
    assert set(result["summary"]) == {"dra-greedy", "dra-stubborn"}
    trials = {t["label"]: t for t in result["trials"]}
    assert set(trials) == {"dra-greedy-0", "dra-greedy-1", "dra-stubborn-0"}
    for t in trials.values():
        assert t["dra_share_bytes"] == 4 * GIB
        assert t["dra_limit_seen_s"] is not None
        assert t["dra_modest_alive"] is True
        assert t["cross_to_term_s"] is not None
    assert trials["dra-stubborn-0"]["exit_code"] == -9  # the SIGKILL path
    assert {s["pod"] for s in result["enforcer_signals"]} == set(trials)
    assert 'sources = ["gpuguard", "dra"]' in (out / "config.toml").read_text()
    rows = [line.split()[0] for line in printed.splitlines() if line.startswith("dra-")]
    assert {"dra-greedy", "dra-stubborn"} <= set(rows), printed


def test_the_pods_file_mode_still_runs_its_greedy_and_stubborn_trials_on_the_stand_in(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The modes --dra left alone: annotation limits from a pods file, no DRA rows."""
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "2", "--stubborn-trials", "1", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["mode"] == "PodsFile"
    assert "dra" not in result
    assert result["wrong_kills"] == []
    assert {k: v["ok"] for k, v in result["summary"].items()} == {"greedy": 2, "stubborn": 1}
    assert 'sources = ["gpuguard"]' in (out / "config.toml").read_text()
    assert {s["pod"] for s in result["enforcer_signals"]} == {"greedy", "stubborn"}
    # No --unallocated-trials: no pod-resources socket read, no unallocated pod, no inspect.
    assert 'pod_resources_socket = ""' in (out / "config.toml").read_text()
    assert "unallocated" not in result
    assert "unallocated" not in result["cgroups"]
    assert not (out / "inspect.txt").exists()
