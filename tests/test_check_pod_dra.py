"""gpuguard check-pod and DRA: the memory share each container would be held
to, read from the ResourceClaimTemplates and ResourceClaims next to the pods.

The manifests are shaped like the objects a real v1.37.2 kube-apiserver, controller-manager and
scheduler produced with NVIDIA's driver in ``memory`` mode (the template ``gpu-10gi``, pods
``p1``..``p5``, the claims made from them): a request is rounded up to the 1Mi step (``1500M`` →
``1431Mi``), an allocated claim is held to its ``consumedCapacity``, no request is the whole GPU.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.commands.check_pod import run_check_pod
from gpuguard.kubemodel.dra import (
    claim_from_json,
    dra_declaration,
    pod_claims,
    share_refusal,
    slice_devices,
)
from gpuguard.kubemodel.dra_templates import (
    MAX_REQUESTS,
    MAX_SHARE_BYTES,
    claim_object,
    round_up_to_step,
)

GI = 1 << 30
MI = 1 << 20
DRA_CONFIG = 'version = 1\n[limits]\nsources = ["gpuguard", "dra"]\n'
NOT_LISTED = "limits.sources does not list dra"


def template(name: str, *requests: dict[str, Any], namespace: str = "team-a") -> dict[str, Any]:
    return {
        "kind": "ResourceClaimTemplate",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"metadata": {}, "spec": {"devices": {"requests": list(requests)}}},
    }


def request(name: str, memory: object = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": "gpu.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"name": name, "exactly": exactly}


def pod(
    name: str,
    claims: dict[str, dict[str, str]],
    containers: dict[str, list[dict[str, str]]],
    *,
    annotation: str | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "team-a"}
    if annotation is not None:
        metadata["annotations"] = {"gpuguard.io/gpu-memory-limit": annotation}
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {
            "containers": [
                {"name": c, "image": "registry.invalid/cuda:1", "resources": {"claims": uses}}
                for c, uses in containers.items()
            ],
            "resourceClaims": [{"name": n, **ref} for n, ref in claims.items()],
        },
    }


def from_template(name: str) -> dict[str, str]:
    return {"resourceClaimTemplateName": name}


GPU_10GI = template("gpu-10gi", request("gpu", "10Gi"))
P1 = pod("p1", {"gpu": from_template("gpu-10gi")}, {"main": [{"name": "gpu"}]})


def write(tmp_path: Path, *objects: object, name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


def check(
    tmp_path: Path,
    *objects: object,
    sources_dra: bool = True,
    gpu_memory: str | None = "80Gi",
    as_json: bool = True,
) -> tuple[int, dict[str, dict[str, Any]], str]:
    """Run check-pod on ``objects``; the pods by name (or the table as ``{"": {"text": …}}``)."""
    config: Path | None = None
    if sources_dra:
        config = tmp_path / "config.toml"
        config.write_text(DRA_CONFIG)
    out, err = io.StringIO(), io.StringIO()
    code = run_check_pod(
        files=[write(tmp_path, *objects)],
        config_path=config,
        gpu_memory=gpu_memory,
        as_json=as_json,
        stdout=out,
        stderr=err,
    )
    if not as_json:
        return code, {"": {"text": out.getvalue()}}, err.getvalue()
    pods = {p["name"]: p for p in json.loads(out.getvalue())["pods"]}
    return code, pods, err.getvalue()


def shares(entry: dict[str, Any]) -> list[tuple[str, str, str, int | None]]:
    return [
        (s["container"], s["claim"], s["request"], s["memory_bytes"]) for s in entry["dra_shares"]
    ]


def test_a_template_share_is_the_pods_limit_with_source_dra(tmp_path: Path) -> None:
    code, pods, err = check(tmp_path, GPU_10GI, P1)
    p1 = pods["p1"]
    assert (p1["limit_bytes"], p1["source"]) == (10 * GI, "dra")
    assert shares(p1) == [("main", "gpu", "gpu", 10 * GI)]
    assert p1["dra_shares"][0]["from"] == "ResourceClaimTemplate team-a/gpu-10gi"
    assert p1["errors"] == []
    assert p1["warnings"] == []
    assert code == 0
    assert "skipped" not in err  # the template is read, not skipped


def test_every_existing_key_is_kept_and_a_pod_without_claims_has_no_shares(
    tmp_path: Path,
) -> None:
    plain = {
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": "team-a"},
        "spec": {"containers": [{"name": "main", "image": "x"}]},
    }
    _code, pods, _err = check(tmp_path, plain)
    assert set(pods["plain"]) >= {
        "namespace",
        "name",
        "limit_bytes",
        "source",
        "errors",
        "warnings",
        "kind",
        "object",
        "file",
        "where",
        "declarations",
        "dra_shares",
    }
    assert pods["plain"]["dra_shares"] == []


def test_a_request_of_1500m_is_held_to_1431mi_as_the_scheduler_rounds_it(tmp_path: Path) -> None:
    odd = template("odd", request("gpu", "1500M"))
    p4 = pod("p4", {"gpu": from_template("odd")}, {"main": [{"name": "gpu"}]})
    _code, pods, _err = check(tmp_path, odd, p4)
    assert pods["p4"]["limit_bytes"] == 1431 * MI
    assert round_up_to_step(1_500_000_000) == 1431 * MI
    assert round_up_to_step(1) == MI  # the policy's minimum
    assert round_up_to_step(4 * GI) == 4 * GI


def test_an_allocated_claim_in_the_files_is_held_to_its_consumed_capacity(
    tmp_path: Path,
) -> None:
    """As the real p4: the pod's status names the claim made from its template; that claim's
    ``consumedCapacity`` is what the enforcer uses, not the template's request."""
    odd = template("odd", request("gpu", "1500M"))
    claim = {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": "p4-gpu-46jb7", "namespace": "team-a"},
        "spec": {"devices": {"requests": [request("gpu", "1500M")]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": "gpu-node-1",
                            "device": "gpu-1",
                            "shareID": "0c3b7c8e-0000-4000-8000-000000000000",
                            "consumedCapacity": {"memory": "1432Mi"},
                        }
                    ]
                }
            }
        },
    }
    p4 = pod("p4", {"gpu": from_template("odd")}, {"main": [{"name": "gpu"}]})
    p4["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p4-gpu-46jb7"}]}
    _code, pods, _err = check(tmp_path, odd, claim, p4)
    assert pods["p4"]["limit_bytes"] == 1432 * MI  # the allocation's, not the template's 1431Mi
    assert pods["p4"]["dra_shares"][0]["from"] == "ResourceClaim team-a/p4-gpu-46jb7"


def test_two_requests_of_one_claim_used_by_two_containers_are_summed(tmp_path: Path) -> None:
    two = template("two-gpus", request("a", "4Gi"), request("b", "6Gi"))
    p5 = pod(
        "p5",
        {"gpu": from_template("two-gpus")},
        {"a": [{"name": "gpu", "request": "a"}], "b": [{"name": "gpu", "request": "b"}]},
    )
    _code, pods, _err = check(tmp_path, two, p5)
    assert shares(pods["p5"]) == [("a", "gpu", "a", 4 * GI), ("b", "gpu", "b", 6 * GI)]
    assert pods["p5"]["limit_bytes"] == 10 * GI


def test_a_container_without_a_request_uses_all_of_the_claims_requests(tmp_path: Path) -> None:
    two = template("two-gpus", request("a", "4Gi"), request("b", "6Gi"))
    both = pod("both", {"gpu": from_template("two-gpus")}, {"main": [{"name": "gpu"}]})
    _code, pods, _err = check(tmp_path, two, both)
    assert shares(pods["both"]) == [("main", "gpu", "a", 4 * GI), ("main", "gpu", "b", 6 * GI)]
    assert pods["both"]["limit_bytes"] == 10 * GI


def test_two_containers_on_one_claim_count_it_once(tmp_path: Path) -> None:
    p3 = pod(
        "p3",
        {"gpu": from_template("gpu-10gi")},
        {"a": [{"name": "gpu"}], "b": [{"name": "gpu"}]},
    )
    _code, pods, _err = check(tmp_path, GPU_10GI, p3)
    assert shares(pods["p3"]) == [("a", "gpu", "gpu", 10 * GI), ("b", "gpu", "gpu", 10 * GI)]
    assert pods["p3"]["limit_bytes"] == 10 * GI  # one share, not 20Gi


def test_a_deployments_pod_template_uses_its_claim_template(tmp_path: Path) -> None:
    p1 = pod("ignored", {"gpu": from_template("gpu-10gi")}, {"main": [{"name": "gpu"}]})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "team-a"},
        "spec": {"template": {"metadata": {}, "spec": p1["spec"]}},
    }
    elsewhere = template("gpu-10gi", request("gpu", "1Gi"), namespace="team-b")
    _code, pods, _err = check(tmp_path, elsewhere, GPU_10GI, deployment)
    assert (pods["web"]["limit_bytes"], pods["web"]["source"]) == (10 * GI, "dra")
    assert pods["web"]["object"] == "Deployment team-a/web (pod template)"


def test_a_user_claim_by_name_is_read_too(tmp_path: Path) -> None:
    shared = {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": "shared-20gi", "namespace": "team-a"},
        "spec": {"devices": {"requests": [request("gpu", "20Gi")]}},
    }
    s1 = pod("s1", {"gpu": {"resourceClaimName": "shared-20gi"}}, {"main": [{"name": "gpu"}]})
    _code, pods, _err = check(tmp_path, shared, s1)
    assert (pods["s1"]["limit_bytes"], pods["s1"]["source"]) == (20 * GI, "dra")


def test_the_template_may_be_in_another_file(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    (tmp_path / "c.toml").write_text(DRA_CONFIG)
    code = run_check_pod(
        files=[write(tmp_path, P1, name="pod.yaml"), write(tmp_path, GPU_10GI, name="t.yaml")],
        config_path=tmp_path / "c.toml",
        gpu_memory=None,
        as_json=True,
        stdout=out,
        stderr=err,
    )
    assert json.loads(out.getvalue())["pods"][0]["limit_bytes"] == 10 * GI
    assert code == 0


# --- the pod's annotation never raises the share ---------------------------------------------


def test_an_annotation_above_the_share_is_capped_by_it(tmp_path: Path) -> None:
    p1 = pod(
        "p1", {"gpu": from_template("gpu-10gi")}, {"main": [{"name": "gpu"}]}, annotation="20Gi"
    )
    _code, pods, _err = check(tmp_path, GPU_10GI, p1)
    assert (pods["p1"]["limit_bytes"], pods["p1"]["source"]) == (10 * GI, "dra")
    assert any("20Gi" in w and "capped" in w for w in pods["p1"]["warnings"]), pods["p1"]
    bound = [d["source"] for d in pods["p1"]["declarations"] if d["bound"]]
    assert bound == ["dra"]


def test_an_annotation_below_the_share_binds(tmp_path: Path) -> None:
    p1 = pod(
        "p1", {"gpu": from_template("gpu-10gi")}, {"main": [{"name": "gpu"}]}, annotation="4Gi"
    )
    _code, pods, _err = check(tmp_path, GPU_10GI, p1)
    assert (pods["p1"]["limit_bytes"], pods["p1"]["source"]) == (4 * GI, "annotation")
    # A DRA pod requests no nvidia.com/* resource, yet its annotation does apply.
    assert not any("has no effect" in w for w in pods["p1"]["warnings"])


def test_without_dra_in_limits_sources_shares_are_shown_and_not_a_limit(tmp_path: Path) -> None:
    p1 = pod(
        "p1", {"gpu": from_template("gpu-10gi")}, {"main": [{"name": "gpu"}]}, annotation="20Gi"
    )
    code, pods, _err = check(tmp_path, GPU_10GI, p1, sources_dra=False)
    assert (pods["p1"]["limit_bytes"], pods["p1"]["source"]) == (20 * GI, "annotation")
    assert shares(pods["p1"]) == [("main", "gpu", "gpu", 10 * GI)]
    assert any(NOT_LISTED in w for w in pods["p1"]["warnings"])
    assert code == 0


# --- unknown shares: never a guess ------------------------------------------------------------


def test_a_missing_template_is_named_and_gives_no_dra_limit(tmp_path: Path) -> None:
    other = template("other", request("gpu", "2Gi"))
    p = pod(
        "p",
        {"gpu": from_template("gpu-10gi"), "more": from_template("other")},
        {"main": [{"name": "gpu"}, {"name": "more"}]},
    )
    code, pods, _err = check(tmp_path, other, p)
    assert pods["p"]["warnings"] == [
        "ResourceClaimTemplate team-a/gpu-10gi is not in the files: its share is unknown here, "
        "so no dra limit is shown"
    ]
    assert (pods["p"]["limit_bytes"], pods["p"]["source"]) == (None, None)  # never 2Gi
    assert shares(pods["p"]) == [("main", "more", "gpu", 2 * GI)]
    assert code == 0


def test_a_whole_gpu_request_needs_gpu_memory(tmp_path: Path) -> None:
    whole = template("whole", request("gpu"))
    p = pod("p", {"gpu": from_template("whole")}, {"main": [{"name": "gpu"}]})
    code, pods, _err = check(tmp_path, whole, p, gpu_memory=None)
    assert pods["p"]["limit_bytes"] is None
    assert shares(pods["p"]) == [("main", "gpu", "gpu", None)]
    assert any("--gpu-memory" in e for e in pods["p"]["errors"]), pods["p"]
    assert code == 1
    code, pods, _err = check(tmp_path, whole, p, gpu_memory="80Gi")
    assert (pods["p"]["limit_bytes"], pods["p"]["source"]) == (80 * GI, "dra")
    assert shares(pods["p"]) == [("main", "gpu", "gpu", 80 * GI)]
    assert code == 0


def test_first_available_shows_the_largest_subrequest_with_a_warning(tmp_path: Path) -> None:
    first = template(
        "first",
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "small", "deviceClassName": "gpu.nvidia.com",
                 "capacity": {"requests": {"memory": "4Gi"}}},
                {"name": "big", "deviceClassName": "gpu.nvidia.com",
                 "capacity": {"requests": {"memory": "8Gi"}}},
            ],
        },
    )  # fmt: skip
    p = pod("p", {"gpu": from_template("first")}, {"main": [{"name": "gpu", "request": "gpu"}]})
    _code, pods, _err = check(tmp_path, first, p)
    assert shares(pods["p"]) == [("main", "gpu", "gpu/big", 8 * GI)]
    assert pods["p"]["limit_bytes"] == 8 * GI
    assert any("firstAvailable" in w and "largest" in w for w in pods["p"]["warnings"])


def test_v1beta1_requests_carry_the_capacity_inline(tmp_path: Path) -> None:
    beta = template("gpu-10gi", {"name": "gpu", "deviceClassName": "gpu.nvidia.com",
                                 "capacity": {"requests": {"memory": "3Gi"}}})  # fmt: skip
    beta["apiVersion"] = "resource.k8s.io/v1beta1"
    _code, pods, _err = check(tmp_path, beta, P1)
    assert pods["p1"]["limit_bytes"] == 3 * GI


def test_the_table_has_one_line_per_share(tmp_path: Path) -> None:
    p3 = pod(
        "p3",
        {"gpu": from_template("gpu-10gi")},
        {"a": [{"name": "gpu"}], "b": [{"name": "gpu"}]},
    )
    _code, out, _err = check(tmp_path, GPU_10GI, p3, as_json=False)
    lines = out[""]["text"].splitlines()
    assert [line for line in lines if "dra share" in line] == [
        "  dra share: container a claim gpu request gpu = 10Gi "
        "(ResourceClaimTemplate team-a/gpu-10gi)",
        "  dra share: container b claim gpu request gpu = 10Gi "
        "(ResourceClaimTemplate team-a/gpu-10gi)",
    ]
    assert any(line.split()[:5] == ["Pod", "team-a", "p3", "10Gi", "dra"] for line in lines)


# --- hostile values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory", "says"),
    [
        ("-1Gi", "capacity.requests.memory"),
        ("0", "capacity.requests.memory"),
        ("lots", "capacity.requests.memory"),
        ("9" * 70, "capacity.requests.memory"),
        (["10Gi"], "not a quantity"),
        ({"x": 1}, "not a quantity"),
        (True, "not a quantity"),
        (1.5, "not a quantity"),
    ],
)
def test_an_invalid_memory_request_is_an_error_and_no_limit(
    tmp_path: Path, memory: object, says: str
) -> None:
    bad = template("gpu-10gi", request("gpu", memory))
    code, pods, _err = check(tmp_path, bad, P1)
    assert pods["p1"]["limit_bytes"] is None
    assert any(says in e and "gpu-10gi" in e for e in pods["p1"]["errors"]), pods["p1"]
    assert code == 1


def test_a_huge_request_is_bounded_and_said_to_be_unallocatable(tmp_path: Path) -> None:
    huge = template("gpu-10gi", request("gpu", "9Ei"))
    code, pods, _err = check(tmp_path, huge, P1)
    p1 = pods["p1"]
    # Saturated at int64 as the API server does, still a 1Mi multiple, never wrapped.
    assert p1["dra_shares"][0]["memory_bytes"] == MAX_SHARE_BYTES
    assert MAX_SHARE_BYTES % MI == 0
    assert MAX_SHARE_BYTES < 2**63
    assert any("cannot allocate it" in w for w in p1["warnings"]), p1
    assert p1["limit_bytes"] is None  # above the device: no limit shown, as for an annotation
    assert code == 0


def test_an_integer_memory_request_is_bytes(tmp_path: Path) -> None:
    ints = template("gpu-10gi", request("gpu", 1_500_000_000))
    _code, pods, _err = check(tmp_path, ints, P1)
    assert pods["p1"]["limit_bytes"] == 1431 * MI


def test_ten_thousand_requests_are_refused_unread(tmp_path: Path) -> None:
    many = template("gpu-10gi", *(request(f"r{i}", "1Gi") for i in range(10_000)))
    code, pods, _err = check(tmp_path, many, P1)
    assert pods["p1"]["limit_bytes"] is None
    assert any(f"more than the {MAX_REQUESTS}" in e for e in pods["p1"]["errors"])
    assert code == 1


@pytest.mark.parametrize(
    "spec",
    [
        "a string",
        {"spec": []},
        {"spec": {"devices": {"requests": "gpu"}}},
        {"spec": {"devices": {"requests": [None, 3, {"name": 7}]}}},
        {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"capacity": 5}}]}}},
        {"spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [1] * 100}]}}},
    ],
)
def test_wrong_shapes_in_a_template_are_errors_never_a_limit(tmp_path: Path, spec: object) -> None:
    bad = template("gpu-10gi")
    bad["spec"] = spec
    code, pods, _err = check(tmp_path, bad, P1)
    assert pods["p1"]["source"] is None
    assert any("ResourceClaimTemplate team-a/gpu-10gi: " in e for e in pods["p1"]["errors"])
    assert code == 1


@pytest.mark.parametrize(
    "claims",
    [
        "gpu",
        [{"name": "gpu"}],
        [{"name": "gpu", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}],
        [{"name": ["gpu"], "resourceClaimTemplateName": "gpu-10gi"}],
        [{"name": "gpu", "resourceClaimTemplateName": 5}],
        [{"name": f"c{i}", "resourceClaimTemplateName": "gpu-10gi"} for i in range(10_000)],
    ],
)
def test_wrong_shapes_in_a_pods_claims_never_raise_and_give_no_dra_limit(
    tmp_path: Path, claims: object
) -> None:
    p = pod("p1", {}, {"main": [{"name": "gpu"}]})
    p["spec"]["resourceClaims"] = claims
    code, pods, _err = check(tmp_path, GPU_10GI, p)
    assert pods["p1"]["source"] is None
    assert pods["p1"]["errors"], pods["p1"]
    assert code == 1


@pytest.mark.parametrize(
    "uses",
    [
        "gpu",
        [None],
        [{"name": 3}],
        [{"name": "gpu", "request": ["a"]}],
        [{"name": "nope"}],
        [{"name": "gpu", "request": "nope"}],
        [{"name": "gpu"} for _ in range(10_000)],
    ],
)
def test_wrong_container_claims_are_errors_never_a_limit(tmp_path: Path, uses: object) -> None:
    p = pod("p1", {"gpu": from_template("gpu-10gi")}, {"main": []})
    p["spec"]["containers"][0]["resources"]["claims"] = uses
    code, pods, _err = check(tmp_path, GPU_10GI, p)
    assert pods["p1"]["source"] != "dra"
    assert pods["p1"]["errors"], pods["p1"]
    assert code == 1


@pytest.mark.parametrize(
    "status",
    [
        {"allocation": {"devices": {"results": "x"}}},
        {"allocation": {"devices": {"results": [{"request": "gpu"} for _ in range(10_000)]}}},
        {"allocation": {"devices": {"results": [{"request": "gpu", "consumedCapacity": 7}]}}},
        {"allocation": {"devices": {"results": [
            {"request": "gpu", "consumedCapacity": {"memory": "-5Gi"}}]}}},
    ],
)  # fmt: skip
def test_a_hostile_allocation_is_an_error_and_no_limit(tmp_path: Path, status: object) -> None:
    claim = {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": "c", "namespace": "team-a"},
        "status": status,
    }
    p = pod("p1", {"gpu": {"resourceClaimName": "c"}}, {"main": [{"name": "gpu"}]})
    code, pods, _err = check(tmp_path, claim, p)
    assert pods["p1"]["limit_bytes"] is None
    assert pods["p1"]["errors"]
    assert code == 1


def test_an_unknown_api_version_is_an_error(tmp_path: Path) -> None:
    alpha = dict(GPU_10GI, apiVersion="resource.k8s.io/v1alpha3")
    code, pods, _err = check(tmp_path, alpha, P1)
    assert any("v1alpha3" in e for e in pods["p1"]["errors"])
    assert pods["p1"]["limit_bytes"] is None
    assert code == 1


@pytest.mark.parametrize("obj", [{}, {"kind": "ResourceClaim"}, {"kind": "ResourceClaim",
                                 "metadata": {"name": ["x"]}}, {"kind": "Service"}])  # fmt: skip
def test_claim_object_ignores_what_is_not_a_named_claim(obj: dict[str, Any]) -> None:
    assert claim_object(obj, where="f.yaml: document 1") is None


@pytest.mark.parametrize(
    "statuses",
    ["x", [{"name": 5, "resourceClaimName": "p1-gpu-7w5lv"}], [{"resourceClaimName": ""}]],
)
def test_check_pod_reads_a_pods_claim_references_as_the_enforcer_does(
    tmp_path: Path, statuses: object
) -> None:
    """One reader (``dra.pod_claim_refs``): a malformed ``status.resourceClaimStatuses``, which
    leaves the enforcer without a dra limit, is an error in check-pod too, never its template's
    share."""
    p = dict(P1, status={"resourceClaimStatuses": statuses})
    code, pods, _err = check(tmp_path, GPU_10GI, p)
    assert pod_claims(p).errors
    assert pods["p1"]["source"] is None
    assert any("status.resourceClaimStatuses" in e for e in pods["p1"]["errors"]), pods["p1"]
    assert code == 1


# --- one reading of DRA: check-pod accepts exactly what the enforcer accepts ---------------------


def classed(name: str, device_class: object, memory: str = "4Gi") -> dict[str, Any]:
    out = request(name, memory)
    out["exactly"]["deviceClassName"] = device_class
    return out


@pytest.mark.parametrize("device_class", ["fpga.example.com", "nic.example.com", 7, None])
def test_a_request_of_another_device_class_is_no_gpu_share(
    tmp_path: Path, device_class: object
) -> None:
    """The enforcer holds pods only to shares of NVIDIA's GPU driver's GPUs; check-pod cannot
    tell which devices another class selects, so it shows no share of it (it said so)."""
    other = template("other", classed("dev", device_class))
    p = pod("p", {"dev": from_template("other")}, {"main": [{"name": "dev"}]})
    _code, pods, _err = check(tmp_path, other, p)
    assert pods["p"]["dra_shares"] == []
    assert pods["p"]["source"] != "dra"
    assert any("not one of NVIDIA's GPU DeviceClasses" in w for w in pods["p"]["warnings"])


def test_a_gpu_request_beside_another_class_is_still_held_to_its_share(tmp_path: Path) -> None:
    both = template("both", classed("gpu", "gpu.nvidia.com", "6Gi"), classed("nic", "x.io"))
    p = pod("p", {"c": from_template("both")}, {"main": [{"name": "c"}]})
    _code, pods, _err = check(tmp_path, both, p)
    assert shares(pods["p"]) == [("main", "c", "gpu", 6 * GI)]
    assert (pods["p"]["limit_bytes"], pods["p"]["source"]) == (6 * GI, "dra")


def allocated_claim(device_class: str, driver: str) -> dict[str, Any]:
    result = {
        "request": "gpu", "driver": driver, "pool": "gpu-node-1", "device": "dev-0",
        "shareID": "0c3b7c8e-0000-4000-8000-000000000001", "consumedCapacity": {"memory": "4Gi"},
    }  # fmt: skip
    return {
        "kind": "ResourceClaim",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": "mine", "namespace": "team-a"},
        "spec": {"devices": {"requests": [classed("gpu", device_class)]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def enforcer_shares(device_type: str, driver: str) -> tuple[int, str | None]:
    """What the enforcer reads of the same allocation on a node whose slice publishes the
    device with that type: (shares, why unresolved)."""
    attributes: dict[str, Any] = {"type": {"string": device_type}}
    if device_type == "mig":  # a static MIG device: its own uuid, its GPU's
        attributes["parentUUID"] = {"string": "GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0001"}
        attributes["uuid"] = {"string": "MIG-5c3e3a8f-0000-0000-0000-00000000000a"}
    else:
        attributes["uuid"] = {"string": "GPU-6f1d6a5c-0b6e-4a55-9d1a-2f0e7c1a0001"}
    slice_ = {
        "spec": {
            "driver": driver, "nodeName": "n",
            "devices": [{"name": "dev-0", "attributes": attributes}],
            "pool": {"name": "gpu-node-1", "generation": 1, "resourceSliceCount": 1},
        }
    }  # fmt: skip
    claim = claim_from_json(allocated_claim("gpu.nvidia.com", driver))
    assert claim is not None
    manifest = pod("p", {"gpu": {"resourceClaimName": "mine"}}, {"main": [{"name": "gpu"}]})
    decl = dra_declaration(pod_claims(manifest), {claim.key: claim}, slice_devices([slice_]))
    assert decl is not None
    return len(decl.shares), decl.unresolved


@pytest.mark.parametrize(
    ("device_class", "device_type", "driver"),
    [
        ("gpu.nvidia.com", "gpu", "gpu.nvidia.com"),
        ("mig.nvidia.com", "mig", "gpu.nvidia.com"),
        ("vfio.gpu.nvidia.com", "vfio", "gpu.nvidia.com"),
        ("gpu.nvidia.com", "gpu", "dra.example.com"),
        ("mig.nvidia.com", "mig", "dra.example.com"),
    ],
)
def test_check_pod_accepts_exactly_the_shares_the_enforcer_accepts(
    tmp_path: Path, device_class: str, device_type: str, driver: str
) -> None:
    """One allocation, read by check-pod from the files (the class the request names, the
    result's driver) and by the enforcer from the node's slice (the device's type): both take
    it as a share, or neither does, for the same reason (``dra.share_refusal``)."""
    p = pod("p", {"gpu": {"resourceClaimName": "mine"}}, {"main": [{"name": "gpu"}]})
    _code, pods, _err = check(tmp_path, allocated_claim(device_class, driver), p)
    previewed = len(pods["p"]["dra_shares"])
    enforced, unresolved = enforcer_shares(device_type, driver)
    assert previewed == enforced
    refusal = share_refusal(driver, device_type)
    assert (enforced == 1) == (refusal is None)
    if refusal is not None and driver == "gpu.nvidia.com":
        assert any(refusal in w for w in pods["p"]["warnings"])
    assert unresolved is None
