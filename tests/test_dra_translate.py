"""The pure translation of DRA objects (``kubemodel.dra``), on the objects a real v1.37.2
kube-apiserver, controller-manager and scheduler wrote (``tests/data/dra``, recorded with kwok
nodes and NVIDIA's ResourceSlice with consumable memory shares), checked end to end through
``core.limits.resolve_limit``: the limit each pod is held to on each GPU, and hostile values of
any type in any field (never an exception)."""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import (
    Declaration,
    DraShare,
    GpuDevice,
    GpuUuid,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Pod,
    PodUid,
    ResolvedLimit,
)
from gpuguard.kubemodel.dra import (
    MAX_DEVICES,
    MISSING,
    Claim,
    ClaimKey,
    ClaimState,
    ClaimUse,
    PodClaims,
    SlicedDevice,
    SliceDevice,
    claim_from_json,
    dra_declaration,
    pod_claims,
    ration_claims,
    slice_devices,
)
from rigs.dra_objects import H100_PROFILES, dynamic_mig_slices
from tests.helpers.documents import nested_documents

DATA = Path(__file__).parent / "data" / "dra"
GiB, MiB = 1 << 30, 1 << 20
WHOLE = 81559 * MiB
"""The H100's memory as the driver publishes it (rounded down to 1Mi)."""
DEFAULT = 2 * GiB
POLICY = LimitPolicy(sources=("gpuguard", "dra"), cluster_default=LimitValue(limit_bytes=DEFAULT))
NS = "team-a"


def load(name: str) -> Any:
    return yaml.safe_load((DATA / name).read_text())


SLICE = load("resourceslice-as-published.yaml")
DEVICES = slice_devices([SLICE])
UUID0 = GpuUuid("GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0001")
UUID1 = GpuUuid("GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0002")
GPU0 = GpuDevice(index=0, uuid=UUID0, name="NVIDIA H100 80GB HBM3", total_bytes=WHOLE)
GPU1 = GpuDevice(index=1, uuid=UUID1, name="NVIDIA H100 80GB HBM3", total_bytes=WHOLE)


def all_claims() -> dict[ClaimKey, ClaimState]:
    out: dict[ClaimKey, ClaimState] = {}
    for path in sorted(DATA.glob("claim-*.yaml")):
        claim = claim_from_json(yaml.safe_load(path.read_text()))
        assert claim is not None, path
        out[claim.key] = claim
    return out


CLAIMS = all_claims()


def key(name: str) -> ClaimKey:
    return ClaimKey(namespace=NS, name=name)


def declaration(
    manifest: Any,
    claims: dict[ClaimKey, ClaimState] | None = None,
    devices: dict[SliceDevice, SlicedDevice] | None = None,
) -> Declaration | None:
    return dra_declaration(
        pod_claims(manifest),
        CLAIMS if claims is None else claims,
        DEVICES if devices is None else devices,
    )


def limit(
    manifest: Any,
    device: GpuDevice,
    *,
    claims: dict[ClaimKey, ClaimState] | None = None,
    devices: dict[SliceDevice, SlicedDevice] | None = None,
    policy: LimitPolicy = POLICY,
) -> ResolvedLimit:
    decl = declaration(manifest, claims, devices)
    declared = {} if decl is None else {LimitSource.DRA: decl}
    pod = Pod(uid=PodUid("u"), namespace=NS, name="p", declared=declared)
    return resolve_limit(
        pod=pod, device_total_bytes=device.total_bytes, policy=policy, replicas=None,
        device=device,
    )  # fmt: skip


# --- the recorded objects ---------------------------------------------------------------------


def uuids(found: dict[SliceDevice, SlicedDevice]) -> dict[SliceDevice, GpuUuid]:
    """The full GPUs found, by NVML UUID."""
    return {key: device.uuid for key, device in found.items() if device.uuid is not None}


def test_the_slice_names_both_gpus_by_the_uuid_attribute() -> None:
    assert uuids(DEVICES) == {
        ("gpu.nvidia.com", "gpu-node-1", "gpu-0"): UUID0,
        ("gpu.nvidia.com", "gpu-node-1", "gpu-1"): UUID1,
    }
    listed = load("resourceslices-fieldselector-nodeName.yaml")["items"]
    assert slice_devices(listed) == DEVICES


def test_p1_is_held_to_its_10gi_share_on_the_gpu_it_was_allocated() -> None:
    result = limit(load("pod-p1.yaml"), GPU1)
    assert (result.limit_bytes, result.source, result.errors) == (10 * GiB, LimitSource.DRA, ())
    (share,) = result.declarations[0].shares
    assert (share.claim_name, share.request, share.device, share.uuid) == (
        "p1-gpu-7w5lv", "gpu", "gpu-1", UUID1,
    )  # fmt: skip
    assert share.share_id == "ba1ce075-ddac-4725-953f-954278b50e50"


def test_memory_on_a_gpu_its_claims_did_not_allocate_is_unassigned_and_falls_to_the_default() -> (
    None
):
    result = limit(load("pod-p1.yaml"), GPU0)
    assert (result.limit_bytes, result.source) == (DEFAULT, LimitSource.DEFAULT)
    assert result.unassigned == (LimitSource.DRA,)
    without_default = limit(load("pod-p1.yaml"), GPU0, policy=replace(POLICY, cluster_default=None))
    assert without_default.limit_bytes is None
    assert not without_default.errors


def test_p4_is_held_to_the_consumed_1431mi_not_the_requested_1500m() -> None:
    assert (
        load("claim-p4-gpu-46jb7.yaml")["spec"]["devices"]["requests"][0]["exactly"]["capacity"][
            "requests"
        ]["memory"]
        == "1500M"
    )
    assert limit(load("pod-p4.yaml"), GPU1).limit_bytes == 1431 * MiB


def test_p5_two_results_of_one_claim_on_one_device_add_up() -> None:
    decl = declaration(load("pod-p5.yaml"))
    assert decl is not None
    assert sorted((s.request, s.memory_bytes) for s in decl.shares) == [
        ("a", 4 * GiB), ("b", 6 * GiB),
    ]  # fmt: skip
    assert len({s.share_id for s in decl.shares}) == 2
    assert limit(load("pod-p5.yaml"), GPU1).limit_bytes == 10 * GiB


def test_a_container_naming_one_request_uses_only_that_requests_results() -> None:
    manifest = load("pod-p5.yaml")
    del manifest["spec"]["containers"][1]  # only container a, request a, is left
    claims = pod_claims(manifest)
    assert claims.uses[0].requests == frozenset({"a"})
    assert claims.uses[0].containers == ("a",)
    assert limit(manifest, GPU1).limit_bytes == 4 * GiB


def test_p3_two_containers_on_one_claim_count_it_once() -> None:
    claims = pod_claims(load("pod-p3.yaml"))
    (use,) = claims.uses
    assert (use.requests, use.containers) == (None, ("trainer", "sidecar"))
    assert limit(load("pod-p3.yaml"), GPU1).limit_bytes == 10 * GiB


@pytest.mark.parametrize("name", ["pod-s1.yaml", "pod-s2.yaml"])
def test_each_pod_of_a_shared_claim_is_held_to_the_full_share(name: str) -> None:
    result = limit(load(name), GPU1)
    assert (result.limit_bytes, result.source) == (20 * GiB, LimitSource.DRA)
    (share,) = result.declarations[0].shares
    assert share.pods_sharing == 2
    assert any("reserved for 2 pods" in w and "each of them" in w for w in result.warnings)


def test_the_extended_resource_path_holds_the_pod_to_the_whole_gpu_it_consumed() -> None:
    manifest = load("pod-ext.yaml")
    assert "resourceClaims" not in manifest["spec"]
    claims = pod_claims(manifest)
    assert claims.uses == (
        ClaimUse(
            key=key("ext-extended-resources-kkl98"),
            requests=frozenset({"container-0-request-0"}),
            containers=("main",),
        ),
    )
    result = limit(manifest, GPU0)
    assert (result.limit_bytes, result.source) == (WHOLE, LimitSource.DRA)
    assert limit(manifest, GPU1).unassigned == (LimitSource.DRA,)


def test_a_claim_deleted_while_its_pod_runs_is_still_allocated_and_still_binds() -> None:
    mid = load("mid-run-deletes.yaml")["p1 claim after DELETE while p1 runs"]
    claim = claim_from_json(mid)
    assert claim is not None
    assert claim.deleting
    assert claim.allocated
    assert limit(load("pod-p1.yaml"), GPU1, claims={claim.key: claim}).limit_bytes == 10 * GiB


def test_a_shared_claim_keeps_its_share_for_the_last_pod_and_is_forgotten_once_deallocated() -> (
    None
):
    after = load("after-deletes.yaml")
    one_left = claim_from_json(after["shared-20gi after s1 deleted"])
    assert one_left is not None
    assert one_left.reserved_for == 1
    result = limit(load("pod-s2.yaml"), GPU1, claims={one_left.key: one_left})
    assert result.limit_bytes == 20 * GiB
    assert not result.warnings
    released = claim_from_json(after["shared-20gi after s2 deleted"])
    assert released is not None
    assert not released.allocated
    assert released.results == ()
    result = limit(load("pod-s2.yaml"), GPU1, claims={released.key: released})
    assert (result.limit_bytes, result.source) == (DEFAULT, LimitSource.DEFAULT)
    assert any("not allocated" in w for w in result.warnings)


def test_a_claim_not_allocated_yet_grants_nothing() -> None:
    decl = declaration(load("pod-whole.yaml"))
    assert decl is not None
    assert decl.shares == ()
    assert decl.unresolved is None
    assert limit(load("pod-whole.yaml"), GPU1).source is LimitSource.DEFAULT


# --- what is not known yet: held like a pod that declares nothing, never a guess --------------


def held_like_a_pod_without_a_declaration(result: ResolvedLimit) -> bool:
    """The default, and a stand-in: a violation waits for a read of the claims (core.policy)."""
    return (result.limit_bytes, result.source, result.awaits_dra) == (
        DEFAULT,
        LimitSource.DEFAULT,
        True,
    )


def test_a_template_claim_not_named_yet_is_pending_and_leaves_the_limit_unresolved() -> None:
    manifest = load("pod-p1.yaml")
    del manifest["status"]["resourceClaimStatuses"]
    claims = pod_claims(manifest)
    assert (claims.uses, claims.pending) == ((), ("gpu",))
    for device in (GPU0, GPU1):
        result = limit(manifest, device)
        assert held_like_a_pod_without_a_declaration(result), result
        assert any("not created yet" in e for e in result.errors), result.errors


def test_a_claim_status_without_a_claim_name_means_no_claim_was_needed() -> None:
    manifest = load("pod-p1.yaml")
    manifest["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": None}]
    assert pod_claims(manifest) == PodClaims(running=True)
    assert declaration(manifest) is None


@pytest.mark.parametrize(
    ("state", "said"),
    [(None, "not read yet"), ("GET …: HTTP 403: forbidden", "HTTP 403")],
)
def test_a_claim_not_read_or_unreadable_leaves_the_limit_unresolved(
    state: str | None, said: str
) -> None:
    claims: dict[ClaimKey, ClaimState] = {} if state is None else {key("p1-gpu-7w5lv"): state}
    decl = declaration(load("pod-p1.yaml"), claims)
    assert decl is not None
    assert decl.unresolved is not None
    assert said in decl.unresolved
    assert "team-a/p1-gpu-7w5lv" in decl.unresolved
    result = limit(load("pod-p1.yaml"), GPU1, claims=claims)
    assert held_like_a_pod_without_a_declaration(result), result
    assert any(said in e for e in result.errors)


def test_a_claim_gone_is_forgotten_and_the_default_applies() -> None:
    result = limit(load("pod-p1.yaml"), GPU1, claims={key("p1-gpu-7w5lv"): MISSING})
    assert (result.limit_bytes, result.source) == (DEFAULT, LimitSource.DEFAULT)
    assert any("gone" in w for w in result.warnings)


def test_a_device_no_slice_names_leaves_the_limit_unresolved() -> None:
    result = limit(load("pod-p1.yaml"), GPU1, devices={})
    assert held_like_a_pod_without_a_declaration(result), result
    assert any("ResourceSlice" in e for e in result.errors)


def test_an_unreadable_claim_beside_a_malformed_one_stays_unresolved_and_waits() -> None:
    """An error alone lets the default bind at once; while another claim is unknown, the
    default stands in for the shares and a violation waits for a read of the claims."""
    manifest = load("pod-p1.yaml")
    manifest["spec"]["resourceClaims"].append({"name": "more", "resourceClaimName": "other"})
    manifest["spec"]["containers"][0]["resources"]["claims"].append({"name": "more"})
    bad = copy.deepcopy(load("claim-p1-gpu-7w5lv.yaml"))
    bad["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"] = "lots"
    broken = claim_from_json(bad)
    assert broken is not None
    assert broken.error is not None
    assert broken.results == ()
    result = limit(manifest, GPU1, claims={broken.key: broken})
    assert held_like_a_pod_without_a_declaration(result), result
    alone = limit(load("pod-p1.yaml"), GPU1, claims={broken.key: broken})
    assert (alone.limit_bytes, alone.source, alone.awaits_dra) == (
        DEFAULT,
        LimitSource.DEFAULT,
        False,
    )
    assert any("'lots'" in e for e in alone.errors), alone.errors


# --- the fields' meaning, one at a time --------------------------------------------------------


def claim(results: list[dict[str, Any]], **status: Any) -> dict[str, Any]:
    return {
        "kind": "ResourceClaim",
        "metadata": {"namespace": NS, "name": "c", "uid": "u-c", "resourceVersion": "7"},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
            **status,
        },
    }


def result(request: str = "gpu", memory: object = "10Gi", **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "request": request, "driver": "gpu.nvidia.com", "pool": "gpu-node-1", "device": "gpu-1",
        "shareID": "s-" + request, **fields,
    }  # fmt: skip
    if memory is not None:
        out["consumedCapacity"] = {"memory": memory}
    return out


def pod_using(*claims: dict[str, Any], init: bool = False) -> dict[str, Any]:
    group = "initContainers" if init else "containers"
    return {
        "metadata": {"namespace": NS, "name": "p", "uid": "u"},
        "spec": {
            "resourceClaims": [{"name": "c", "resourceClaimName": "c"}],
            group: [{"name": "main", "resources": {"claims": list(claims)}}],
        },
    }


def shares_of(pod: dict[str, Any], obj: dict[str, Any]) -> tuple[DraShare, ...]:
    parsed = claim_from_json(obj)
    assert parsed is not None
    decl = declaration(pod, {parsed.key: parsed})
    assert decl is not None
    assert decl.error is None, decl
    return decl.shares


def test_a_first_available_subrequest_belongs_to_its_request() -> None:
    obj = claim([result("gpu/small", "4Gi"), result("other", "6Gi")])
    (share,) = shares_of(pod_using({"name": "c", "request": "gpu"}), obj)
    assert (share.request, share.memory_bytes) == ("gpu/small", 4 * GiB)


def test_an_init_container_using_a_claim_uses_it() -> None:
    assert len(shares_of(pod_using({"name": "c"}, init=True), claim([result()]))) == 1


def test_results_of_other_drivers_are_not_gpu_shares() -> None:
    obj = claim([result(driver="dra.example.com"), result("b", "2Gi")])
    assert [s.request for s in shares_of(pod_using({"name": "c"}), obj)] == ["b"]


def test_a_result_without_consumed_memory_or_with_zero_is_the_whole_device() -> None:
    """``unlimited`` and ``<N>`` share modes consume ``memory: 0``: no memory was accounted."""
    for memory in (None, "0", 0):
        (share,) = shares_of(pod_using({"name": "c"}), claim([result(memory=memory)]))
        assert share.memory_bytes is None, memory
    parsed = claim_from_json(claim([result(memory="0")]))
    decl = declaration(pod_using({"name": "c"}), {key("c"): parsed} if parsed else {})
    pod = Pod(
        uid=PodUid("u"), namespace=NS, name="p", declared={LimitSource.DRA: decl or Declaration()}
    )
    resolved = resolve_limit(
        pod=pod, device_total_bytes=WHOLE, policy=POLICY, replicas=None, device=GPU1
    )
    assert (resolved.limit_bytes, resolved.source) == (WHOLE, LimitSource.DRA)


# --- DynamicMIG: a full GPU advertises its largest MIG profile's memory -------------------------

DYNAMIC_MIG = dynamic_mig_slices({"metadata": {"name": "gpu-node-1", "uid": "n"}}, [UUID0, UUID1])
"""The node's slices as the driver publishes them with DynamicMIG and ``memory`` shares on."""
LARGEST_PROFILE = H100_PROFILES[-1].memory_mib * MiB


def dynamic_mig_limit(memory: object, device: str = "gpu-1") -> ResolvedLimit:
    parsed = claim_from_json(claim([result(memory=memory, device=device)]))
    assert parsed is not None
    return limit(pod_using({"name": "c"}), GPU1, claims={parsed.key: parsed},
                 devices=slice_devices(DYNAMIC_MIG))  # fmt: skip


def test_on_a_dynamic_mig_node_a_full_gpu_advertises_less_memory_than_it_has() -> None:
    found = slice_devices(DYNAMIC_MIG)
    assert found[("gpu.nvidia.com", "gpu-node-1", "gpu-1")] == SlicedDevice(
        uuid=UUID1, memory_bytes=LARGEST_PROFILE
    )
    assert GPU1.total_bytes > LARGEST_PROFILE


def test_a_whole_gpu_claim_on_a_dynamic_mig_node_is_held_to_the_gpus_real_memory() -> None:
    """A claim with no memory request consumes the policy's default, all the device advertises:
    the largest MIG profile's memory. The scheduler gave the pod the whole GPU, so the pod is
    held to NVML's total, not to the advertised number (a pod preallocating 80 GB of an H100
    would otherwise be stopped). Asking for all of it (or, hostile, more) is the same."""
    for memory in (f"{H100_PROFILES[-1].memory_mib}Mi", LARGEST_PROFILE + MiB, None):
        result_ = dynamic_mig_limit(memory)
        assert (result_.limit_bytes, result_.source) == (GPU1.total_bytes, LimitSource.DRA)
        (share,) = result_.declarations[0].shares
        assert share.memory_bytes is None, memory


def test_a_share_below_what_the_device_advertises_is_held_to_the_share() -> None:
    """A share is what the scheduler accounted: only a whole device becomes the device."""
    one_mib_short = dynamic_mig_limit(LARGEST_PROFILE - MiB)
    assert one_mib_short.limit_bytes == LARGEST_PROFILE - MiB
    assert dynamic_mig_limit("10Gi").limit_bytes == 10 * GiB


def test_a_device_whose_advertised_memory_cannot_be_read_holds_the_share_as_accounted() -> None:
    for value in (None, "lots", ["80Gi"], {"v": 1}, True, "9" * 99):
        gpu = gpu_device("gpu-1", UUID1)
        if value is not None:
            gpu["capacity"] = {"memory": {"value": value}}
        (found,) = slice_devices([a_slice([gpu])]).values()
        assert found == SlicedDevice(uuid=UUID1, memory_bytes=None)
        parsed = claim_from_json(claim([result(memory="79Gi")]))
        assert parsed is not None
        held = limit(pod_using({"name": "c"}), GPU1, claims={parsed.key: parsed},
                     devices=slice_devices([a_slice([gpu])]))  # fmt: skip
        assert held.limit_bytes == 79 * GiB, value


@pytest.mark.parametrize(
    "memory", ["lots", "-1Gi", "1", "512Ki", "1e999999", ["10Gi"], {"v": 1}, True, 1.5, "x" * 999]
)
def test_a_malformed_consumed_memory_is_an_error_never_a_limit(memory: object) -> None:
    parsed = claim_from_json(claim([result(memory=memory)]))
    if memory == "1e999999":  # saturates at the int64 bound, as the API server: above any GPU
        assert parsed is not None
        assert parsed.error is None
        return
    assert parsed is not None
    assert parsed.error is not None
    assert parsed.results == ()
    decl = declaration(pod_using({"name": "c"}), {parsed.key: parsed})
    assert decl is not None
    assert decl.error is not None
    assert decl.shares == ()


def test_a_container_naming_a_request_the_claim_lacks_gets_nothing_and_a_warning() -> None:
    parsed = claim_from_json(claim([result("gpu")]))
    assert parsed is not None
    decl = declaration(pod_using({"name": "c", "request": "nope"}), {parsed.key: parsed})
    assert decl is not None
    assert decl.shares == ()
    assert any("nope" in w for w in decl.warnings)


def test_a_claim_the_pod_lists_but_no_container_uses_grants_nothing() -> None:
    manifest = load("pod-p1.yaml")
    del manifest["spec"]["containers"][0]["resources"]["claims"]
    assert pod_claims(manifest) == PodClaims(running=True)
    assert declaration(manifest) is None


def test_the_same_claim_named_twice_is_one_share() -> None:
    use = ClaimUse(key=key("p1-gpu-7w5lv"), requests=None, containers=("a",))
    twice = PodClaims(uses=(use, replace(use, requests=frozenset({"gpu"}), containers=("b",))))
    decl = dra_declaration(twice, CLAIMS, DEVICES)
    assert decl is not None
    assert len(decl.shares) == 1


def test_only_pods_count_as_sharers() -> None:
    obj = claim([result()], reservedFor=[
        {"resource": "pods", "name": "a", "uid": "1"},
        {"resource": "pods", "name": "b", "uid": "2"},
        {"resource": "jobs", "apiGroup": "batch", "name": "j", "uid": "3"},
        {"resource": "pods", "apiGroup": "example.com", "name": "x", "uid": "4"},
        "junk",
    ])  # fmt: skip
    parsed = claim_from_json(obj)
    assert parsed is not None
    assert parsed.reserved_for == 2


def test_a_claim_is_read_only_when_it_is_one() -> None:
    good = load("claim-p1-gpu-7w5lv.yaml")
    assert claim_from_json({**good, "kind": "Pod"}) is None
    assert claim_from_json({**good, "metadata": {"name": "x"}}) is None
    assert claim_from_json({**good, "metadata": {"namespace": NS, "name": 7}}) is None
    parsed = claim_from_json(good)
    assert parsed == Claim(
        key=key("p1-gpu-7w5lv"),
        uid=good["metadata"]["uid"],
        resource_version=good["metadata"]["resourceVersion"],
        results=parsed.results if parsed else (),
        allocated=True,
        reserved_for=1,
        deleting=False,
    )


def test_where_names_the_claims_and_stays_short() -> None:
    uses = tuple(
        ClaimUse(key=key(f"claim-{i:03d}-" + "x" * 200), requests=None, containers=("c",))
        for i in range(100)
    )
    decl = dra_declaration(PodClaims(uses=uses), {}, DEVICES)
    assert decl is not None
    assert decl.where.startswith("ResourceClaims team-a/claim-000-")
    assert "and 96 more" in decl.where
    assert len(decl.where) < 800
    assert decl.unresolved is not None
    assert len(decl.unresolved) < 4000
    one = declaration(load("pod-p1.yaml"))
    assert one is not None
    assert one.where == "ResourceClaim team-a/p1-gpu-7w5lv"


# --- slices ------------------------------------------------------------------------------------


def gpu_device(name: str, uuid: object, **attributes: Any) -> dict[str, Any]:
    return {"name": name, "attributes": {"uuid": {"string": uuid}, **attributes}}


def a_slice(devices: list[Any], *, generation: object = 1, pool: str = "gpu-node-1") -> Any:
    return {
        "spec": {
            "driver": "gpu.nvidia.com", "nodeName": "gpu-node-1", "devices": devices,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
        }
    }  # fmt: skip


def test_only_the_newest_generation_of_a_pool_counts() -> None:
    old = a_slice([gpu_device("gpu-0", "GPU-00000000-0000-0000-0000-00000000000a")])
    new = a_slice([gpu_device("gpu-1", UUID1)], generation=2)
    assert uuids(slice_devices([old, new])) == {("gpu.nvidia.com", "gpu-node-1", "gpu-1"): UUID1}
    other_pool = a_slice([gpu_device("gpu-0", UUID0)], pool="elsewhere")
    assert len(slice_devices([old, new, other_pool])) == 2


def test_mig_devices_and_other_uuids_are_no_full_gpus() -> None:
    devices = [
        gpu_device("gpu-0-mig-1g10gb-19-0", "MIG-5c3e3a8f-0000-0000-0000-000000000000",
                   type={"string": "mig"}, parentUUID={"string": UUID0}),
        gpu_device("gpu-1-mig-x", UUID1, type={"string": "mig"}),
        {"name": "gpu-0-mig-dyn", "attributes": {"parentUUID": {"string": UUID0}}},
        gpu_device("gpu-2", "not-a-uuid"),
        gpu_device("gpu-3", {"string": UUID0}),
        {"name": "gpu-4", "attributes": {"gpu.nvidia.com/uuid": {"string": UUID1}}},
        {"name": "gpu-5", "attributes": {"other.example.com/uuid": {"string": UUID0}}},
    ]  # fmt: skip
    assert uuids(slice_devices([a_slice(devices)])) == {
        ("gpu.nvidia.com", "gpu-node-1", "gpu-4"): UUID1
    }


MIG_A = "MIG-5c3e3a8f-0000-0000-0000-00000000000a"
MIG_B = "MIG-5c3e3a8f-0000-0000-0000-00000000000b"
INSTANCE_A = GpuDevice(index=1, uuid=UUID1, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                       total_bytes=40448 * MiB, gpu_instance_id=1, mig_uuid=MIG_A,
                       mig_placement=(9, 0))  # fmt: skip
INSTANCE_B = replace(INSTANCE_A, gpu_instance_id=2, mig_uuid=MIG_B, mig_placement=(9, 4))


def static_mig(name: str, mig_uuid: str, **attributes: Any) -> dict[str, Any]:
    """A static MIG device as the driver's ``MigDeviceInfo.GetDevice`` publishes it."""
    fields = {"type": {"string": "mig"}, "parentUUID": {"string": UUID1},
              "profile": {"string": "3g.40gb"}, **attributes}  # fmt: skip
    device = gpu_device(name, mig_uuid, **fields)
    device["capacity"] = {"memory": {"value": "40448Mi"}}
    return device


STATIC = slice_devices([a_slice([static_mig("gpu-1-mig-3g40gb-9-0", MIG_A),
                                 static_mig("gpu-1-mig-3g40gb-9-4", MIG_B)])])  # fmt: skip


def mig_limit(
    device: GpuDevice, name: str, memory: object = "4Gi", devices: Any = None
) -> ResolvedLimit:
    parsed = claim_from_json(claim([result(memory=memory, device=name)]))
    assert parsed is not None
    return limit(pod_using({"name": "c"}), device, claims={parsed.key: parsed},
                 devices=STATIC if devices is None else devices)  # fmt: skip


def test_a_share_of_a_static_mig_device_holds_its_instance_alone_by_its_own_uuid() -> None:
    """Mapped by the MIG device's own uuid, never by its parentUUID: the share caps the one
    instance, not the GPU's other instance, nor the GPU (a pod there is unassigned)."""
    held = mig_limit(INSTANCE_A, "gpu-1-mig-3g40gb-9-0")
    assert (held.limit_bytes, held.source, held.errors) == (4 * GiB, LimitSource.DRA, ())
    (share,) = held.declarations[0].shares
    assert (share.uuid, share.mig_uuid, share.mig_placement) == (UUID1, MIG_A, None)
    for elsewhere in (INSTANCE_B, replace(INSTANCE_A, mig_uuid=MIG_B), GPU1):
        other = mig_limit(elsewhere, "gpu-1-mig-3g40gb-9-0")
        assert (other.limit_bytes, other.source) == (DEFAULT, LimitSource.DEFAULT), elsewhere
        assert other.unassigned == (LimitSource.DRA,)


def test_a_whole_mig_device_claim_is_held_to_the_instances_memory() -> None:
    for memory in (None, "40448Mi"):
        held = mig_limit(INSTANCE_B, "gpu-1-mig-3g40gb-9-4", memory)
        assert (held.limit_bytes, held.source) == (INSTANCE_B.total_bytes, LimitSource.DRA)


def test_a_share_of_a_dynamic_mig_device_holds_the_instance_of_its_profile_and_placement() -> None:
    """No uuid until the driver makes it: its GPU (parentUUID), profile ID and placement start
    (its name) find the NVML instance."""
    one_g = replace(INSTANCE_A, name="1g.10gb", total_bytes=9984 * MiB, mig_placement=(19, 3))
    dynamic = slice_devices(DYNAMIC_MIG)
    held = mig_limit(one_g, "gpu-1-mig-1g10gb-19-3", devices=dynamic)
    assert (held.limit_bytes, held.source) == (4 * GiB, LimitSource.DRA)
    (share,) = held.declarations[0].shares
    assert (share.uuid, share.mig_uuid, share.mig_placement) == (UUID1, None, (19, 3))
    for elsewhere in (replace(one_g, mig_placement=(19, 4)), replace(one_g, uuid=UUID0), GPU1):
        assert mig_limit(elsewhere, "gpu-1-mig-1g10gb-19-3", devices=dynamic).unassigned == (
            LimitSource.DRA,
        )
    whole = mig_limit(one_g, "gpu-1-mig-1g10gb-19-3", None, devices=dynamic)
    assert whole.limit_bytes == one_g.total_bytes


def test_a_mig_instance_nvml_gave_no_placement_for_leaves_a_dynamic_share_unresolved() -> None:
    unsure = replace(INSTANCE_A, mig_placement=None)
    held = mig_limit(unsure, "gpu-1-mig-1g10gb-19-3", devices=slice_devices(DYNAMIC_MIG))
    assert held_like_a_pod_without_a_declaration(held)
    assert any("did not give the profile and placement" in e for e in held.errors)


@pytest.mark.parametrize(
    ("name", "attributes"),
    [
        ("gpu-1-mig-1g10gb-19-0", {"parentUUID": {"string": "not-a-uuid"}}),
        ("gpu-1-mig-2g20gb-19-0", {}),  # the name's profile is not the device's
        ("gpu-1-mig-1g10gb-19", {}),
        ("mig-1g10gb-19-0", {}),
        ("gpu-1-mig-1g10gb-19-0", {"profile": {"string": 7}}),
        ("gpu-1-mig-1g10gb-19-9999", {}),
    ],
)
def test_a_mig_device_whose_instance_cannot_be_told_is_unresolved_and_says_so(
    name: str, attributes: dict[str, Any]
) -> None:
    """Anything not of the driver's shape is unresolved (held like a pod that declares
    nothing), never a guess, and the error says it is a MIG device, not "in no ResourceSlice"."""
    fields = {"type": {"string": "mig"}, "parentUUID": {"string": UUID1},
              "profile": {"string": "1g.10gb"}, **attributes}  # fmt: skip
    device = {"name": name, "attributes": fields}
    one_g = replace(INSTANCE_A, mig_placement=(19, 0))
    held = mig_limit(one_g, name, devices=slice_devices([a_slice([device])]))
    assert held_like_a_pod_without_a_declaration(held)
    (error,) = [e for e in held.errors if name in e]
    assert "MIG device" in error
    assert "no ResourceSlice" not in error


def test_a_share_on_a_device_of_another_type_is_no_share() -> None:
    """A ``vfio`` GPU is passed to a VM (no process of the node's NVML runs on it): no share,
    said so; the pod falls to its next applicable limit."""
    vfio = gpu_device("gpu-vfio-1", UUID1, type={"string": "vfio"})
    parsed = claim_from_json(claim([result(device="gpu-vfio-1")]))
    assert parsed is not None
    held = limit(pod_using({"name": "c"}), GPU1, claims={parsed.key: parsed},
                 devices=slice_devices([a_slice([vfio])]))  # fmt: skip
    assert (held.limit_bytes, held.source, held.awaits_dra) == (DEFAULT, LimitSource.DEFAULT, False)
    assert any("'vfio', not a GPU" in w for w in held.warnings)


def test_a_device_two_slices_name_with_different_uuids_is_no_device() -> None:
    one = a_slice([gpu_device("gpu-0", UUID0), gpu_device("gpu-1", UUID1)])
    two = a_slice([gpu_device("gpu-0", UUID1)])
    assert uuids(slice_devices([one, two])) == {("gpu.nvidia.com", "gpu-node-1", "gpu-1"): UUID1}


def test_the_devices_read_are_bounded() -> None:
    many = [gpu_device(f"gpu-{i}", UUID0) for i in range(MAX_DEVICES + 500)]
    started = time.monotonic()
    found = slice_devices([a_slice(many[:128]) for _ in range(40)] + [a_slice(many)])
    assert len(found) <= MAX_DEVICES
    assert time.monotonic() - started < 2


# --- hostile input: any type in any field, bounded, never an exception -------------------------


json_values = nested_documents(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    st.text(max_size=12),
    max_keys=4,
    max_leaves=20,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return obj


REAL = {
    "pod": [load(f"pod-{n}.yaml") for n in ("p1", "p3", "p5", "s1", "ext")],
    "claim": [load(p.name) for p in sorted(DATA.glob("claim-*.yaml"))],
    "slice": [SLICE],
}


def _check(pod: Any, claims: list[Any], slices: list[Any]) -> None:
    parsed = [claim_from_json(c) for c in claims]
    states: dict[ClaimKey, ClaimState] = {c.key: c for c in parsed if c is not None}
    devices = slice_devices(slices)
    found = pod_claims(pod)
    assert len(found.errors) <= 8
    decl = dra_declaration(found, states, devices)
    if decl is None:
        return
    assert len(decl.where) < 1000
    gpu_pod = Pod(uid=PodUid("u"), namespace=NS, name="p", declared={LimitSource.DRA: decl})
    for device in (GPU0, GPU1, None):
        resolve_limit(pod=gpu_pod, device_total_bytes=WHOLE, policy=POLICY, replicas=None,
                      device=device)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    which=st.sampled_from(["pod", "claim", "slice"]),
    index=st.integers(min_value=0, max_value=20),
    pick=st.integers(min_value=0),
    junk=json_values,
)
def test_any_value_in_any_field_of_the_real_objects_never_raises(
    which: str, index: int, pick: int, junk: Any
) -> None:
    objects = {k: copy.deepcopy(v) for k, v in REAL.items()}
    target = objects[which][index % len(objects[which])]
    paths = _paths(target)
    _set(target, paths[pick % len(paths)], junk)
    for pod in objects["pod"]:
        _check(pod, objects["claim"], objects["slice"])


@settings(max_examples=200, deadline=None)
@given(pod=json_values, claim_obj=json_values, slice_obj=json_values)
def test_any_json_as_a_pod_claim_or_slice_never_raises(
    pod: Any, claim_obj: Any, slice_obj: Any
) -> None:
    _check(pod if isinstance(pod, dict) else {"spec": pod}, [claim_obj], [slice_obj])
    assert slice_devices(slice_obj if isinstance(slice_obj, list) else []) is not None


def test_huge_and_deep_values_are_refused_quickly() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    huge_pod = {
        "metadata": {"namespace": NS},
        "spec": {
            "resourceClaims": [
                {"name": f"c{i}", "resourceClaimName": f"c{i}"} for i in range(10**5)
            ],
            "containers": [{"name": "m", "resources": {"claims": [{"name": "c0"}] * 10**5}}] * 2000,
        },
        "status": {"resourceClaimStatuses": deep, "extendedResourceClaimStatus": deep},
    }
    started = time.monotonic()
    found = pod_claims(huge_pod)
    assert found.uses == ()
    assert found.errors
    broken = claim([deep] * 100, reservedFor=[{"resource": "pods"}] * 10**6)
    parsed = claim_from_json(broken)
    assert parsed is not None
    assert parsed.error is not None
    assert parsed.reserved_for == 0
    named = claim([result()], reservedFor=deep)
    named["metadata"]["name"] = "n" * 10**6
    assert claim_from_json(named) is None
    assert slice_devices([a_slice(deep), deep, a_slice([deep] * 10**5)] * 100) == {}
    assert time.monotonic() - started < 3


# --- which claims a node reads: decoys crowd nobody out ------------------------------------------


def claim_keys(namespace: str, prefix: str, n: int) -> list[ClaimKey]:
    return [ClaimKey(namespace=namespace, name=f"{prefix}-{i:03d}") for i in range(n)]


def test_claims_of_running_pods_are_read_before_any_that_only_pending_pods_name() -> None:
    # 16 pods setting spec.nodeName themselves, 32 claims each that do not exist, in a namespace
    # that sorts first: they stay Pending on a real kubelet.
    decoys = claim_keys("aaa", "decoy", 16 * 32)
    real = [ClaimKey(namespace="aaa", name="trainer-gpu-x"), ClaimKey(namespace="zzz", name="c")]
    wanted = {**dict.fromkeys(decoys, False), **dict.fromkeys(real, True)}
    read, again = ration_claims(wanted, budget=512, missing_budget=64)
    assert set(real) <= set(read), "read first, whatever their names sort as"
    assert len(read) == 512
    assert again == ()


def test_namespaces_take_turns_so_one_cannot_spend_anothers_share() -> None:
    # Even when every pod runs (kwok runs anything; so would a node whose kubelet lies).
    mine = claim_keys("aaa", "c", 600)
    theirs = claim_keys("bbb", "c", 3)
    small = claim_keys("zzz", "c", 1)
    wanted = dict.fromkeys([*mine, *theirs, *small], True)
    read, _ = ration_claims(wanted, budget=10, missing_budget=0)
    assert set(theirs) | set(small) <= set(read)
    assert read[:3] == (mine[0], theirs[0], small[0]), "one each per round"
    assert sum(1 for k in read if k.namespace == "aaa") == 6, "only what the others leave"


def test_a_claim_that_answered_404_takes_no_slot_and_only_a_few_are_read_again() -> None:
    decoys = claim_keys("aaa", "decoy", 512)
    mine = ClaimKey(namespace="aaa", name="zzz-real")  # sorts after every decoy of its namespace
    wanted = dict.fromkeys([*decoys, mine], True)
    first, _ = ration_claims(wanted, budget=512, missing_budget=64)
    assert mine not in first, "before any is read, names decide"
    read, again = ration_claims(wanted, first, budget=512, missing_budget=64)
    assert read == (mine,)
    assert len(again) == 64
    assert set(again) <= set(first)


@given(
    st.dictionaries(
        st.builds(
            ClaimKey,
            namespace=st.sampled_from(["a", "b", "c", "kube-system"]),
            name=st.text("xyz0123", min_size=1, max_size=4),
        ),
        st.booleans(),
        max_size=60,
    ),
    st.integers(0, 70),
    st.integers(0, 70),
    st.data(),
)
@settings(max_examples=200, deadline=None)
def test_the_ration_is_bounded_fair_and_puts_running_pods_first(
    wanted: dict[ClaimKey, bool], budget: int, missing_budget: int, data: st.DataObject
) -> None:
    missing = data.draw(
        st.sets(st.sampled_from(sorted(wanted, key=str))) if wanted else st.just(set())
    )
    read, again = ration_claims(wanted, missing, budget=budget, missing_budget=missing_budget)
    assert len(read) <= budget
    assert len(again) <= missing_budget
    assert not set(read) & set(missing)
    assert set(again) <= set(missing)
    candidates = [k for k in wanted if k not in missing]
    assert len(read) == min(budget, len(candidates))
    if any(not wanted[k] for k in read):
        assert all(k in read for k in candidates if wanted[k]), "a pending pod's before a running"
    # Max-min fair per tier: a namespace left out had at least as many read as any other.
    for runs in (True, False):
        tier = [k for k in candidates if wanted[k] is runs]
        got = {
            ns: sum(1 for k in read if k.namespace == ns and wanted[k] is runs)
            for ns in {k.namespace for k in tier}
        }
        for ns, n in got.items():
            if n < sum(1 for k in tier if k.namespace == ns):
                assert all(m <= n + 1 for m in got.values()), got


def test_a_pod_runs_when_the_kubelet_says_so_in_its_status() -> None:
    manifest = load("pod-p1.yaml")
    assert pod_claims(manifest).running
    pending = copy.deepcopy(manifest)
    pending["status"] = {**pending["status"], "phase": "Pending"}
    pending["status"].pop("containerStatuses", None)
    assert not pod_claims(pending).running
    pending["status"]["initContainerStatuses"] = [{"name": "i", "state": {"running": {}}}]
    assert pod_claims(pending).running, "an init container runs while the pod is Pending"
