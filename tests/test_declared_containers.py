"""KAI-Scheduler's per-container declarations (docs/schedulers.md, Per-container declarations):
``nvidia.com/container.<c>.gpu-memory.limit`` / ``.request``, the binder's ``.gpus.devices`` pin
and ``gpu-fraction-num-devices``, read as hostile input through the one translation
(``pod_from_json``) and resolved by the one resolution (``core.limits.resolve_limit``): each
container's own limit, and the pod's cap, which per-container keys never raise."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import (
    GpuDevice,
    GpuUuid,
    LimitPolicy,
    LimitSource,
    LimitValue,
    NamespacePolicy,
    Pod,
    ResolvedLimit,
)
from gpuguard.kubemodel.translate import pod_from_json

GiB, MiB = 1 << 30, 1 << 20
DEVICE = 80 * GiB
PREFIX = "nvidia.com/container."
GPU0 = GpuDevice(index=0, uuid=GpuUuid("GPU-00000000-0000-0000-0000-000000000000"), name="H200",
                 total_bytes=DEVICE)  # fmt: skip
GPU1 = GpuDevice(index=1, uuid=GpuUuid("GPU-11111111-1111-1111-1111-111111111111"), name="H200",
                 total_bytes=DEVICE)  # fmt: skip


def pod(annotations: dict[str, Any], containers: tuple[str, ...] = ("main", "side")) -> Pod:
    made = pod_from_json(
        {
            "metadata": {"uid": "u-1", "name": "p", "namespace": "team",
                         "annotations": annotations},
            "spec": {"containers": [{"name": n} for n in containers]},
        }
    )  # fmt: skip
    assert made is not None
    return made


def key(container: str, what: str) -> str:
    return f"{PREFIX}{container}.{what}"


def resolve(
    p: Pod,
    device: GpuDevice | None = None,
    sources: tuple[str, ...] = ("gpuguard", "kai"),
    **policy: Any,
) -> ResolvedLimit:
    return resolve_limit(
        pod=p,
        device_total_bytes=DEVICE,
        policy=LimitPolicy(sources=sources, **policy),
        replicas=None,
        device=device,
    )


def own(r: ResolvedLimit) -> dict[str, int]:
    return {c.container: c.limit_bytes for c in r.containers}


# --- which value binds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param({key("main", "gpu-memory.limit"): "4Gi"}, 4 * GiB, id="limit"),
        pytest.param({key("main", "gpu-memory.request"): "2Gi"}, 2 * GiB, id="request alone"),
        pytest.param({key("main", "gpu-memory.request"): "2Gi",
                      key("main", "gpu-memory.limit"): "6Gi"}, 6 * GiB,
                     id="the limit binds over the request"),
        pytest.param({key("main", "gpu-memory.limit"): "7680Mi"}, 7680 * MiB, id="Mi"),
        pytest.param({key("main", "gpu-memory.limit"): "1024M"}, 977 * MiB,
                     id="decimal bytes, rounded up to whole MiB as KAI's runtime does"),
    ],
)  # fmt: skip
def test_the_limit_binds_and_the_request_only_where_no_limit_is_given(
    annotations: dict[str, str], expected: int
) -> None:
    r = resolve(pod(annotations))
    assert own(r) == {"main": expected}
    assert (r.limit_bytes, r.source) == (expected, LimitSource.KAI)
    assert r.errors == ()


def test_a_request_above_its_limit_is_reported_and_the_limit_binds() -> None:
    r = resolve(pod({key("main", "gpu-memory.request"): "8Gi",
                     key("main", "gpu-memory.limit"): "4Gi"}))  # fmt: skip
    assert own(r) == {"main": 4 * GiB}
    assert any("request ≤ limit" in w for w in r.warnings)


def test_without_kai_in_the_sources_per_container_keys_are_not_read() -> None:
    r = resolve(pod({key("main", "gpu-memory.limit"): "4Gi"}), sources=("gpuguard",))
    assert (r.limit_bytes, r.containers) == (None, ())


# --- hostile values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["0", "-4Gi", "4GB", "4 Gi", "", "lots", "512Ki", "1" * 200, 4096, None, ["4Gi"]],
)
def test_a_malformed_value_is_reported_and_the_admin_default_applies(value: object) -> None:
    p = pod({key("main", "gpu-memory.limit"): value})
    r = resolve(p, cluster_default=LimitValue(limit_bytes=8 * GiB))
    assert (r.limit_bytes, r.source) == (8 * GiB, LimitSource.DEFAULT)
    assert own(r) == {}
    assert any("container main" in e for e in r.errors)


def test_keys_for_containers_the_pod_does_not_have_gain_nothing() -> None:
    p = pod({key("main", "gpu-memory.limit"): "4Gi", key("ghost", "gpu-memory.limit"): "70Gi"})
    r = resolve(p, cluster_default=LimitValue(limit_bytes=8 * GiB))
    assert (r.limit_bytes, own(r)) == (4 * GiB, {"main": 4 * GiB})
    assert any("no container ghost" in e for e in r.errors)
    # Alone, a key for a container the pod lacks declares nothing: the admin default holds.
    alone = resolve(pod({key("ghost", "gpu-memory.limit"): "70Gi"}),
                    cluster_default=LimitValue(limit_bytes=8 * GiB))  # fmt: skip
    assert (alone.limit_bytes, alone.source) == (8 * GiB, LimitSource.DEFAULT)


def test_a_key_per_container_never_multiplies_what_the_pod_may_use() -> None:
    one = resolve(pod({key("main", "gpu-memory.limit"): "4Gi"}))
    every = resolve(
        pod({key(c, "gpu-memory.limit"): "4Gi" for c in ("main", "side", "third")},
            containers=("main", "side", "third"))
    )  # fmt: skip
    assert one.limit_bytes == every.limit_bytes == 4 * GiB
    assert own(every) == {"main": 4 * GiB, "side": 4 * GiB, "third": 4 * GiB}
    assert any("KAI-Scheduler admits one per pod" in w for w in every.warnings)


def test_the_pods_own_cap_binds_over_a_larger_container_declaration() -> None:
    p = pod({key("main", "gpu-memory.limit"): "12Gi", "gpuguard.io/gpu-memory-limit": "5Gi"})
    r = resolve(p)
    assert (r.limit_bytes, r.source) == (5 * GiB, LimitSource.ANNOTATION)
    limit = r.containers[0]
    assert (limit.container, limit.limit_bytes, limit.what) == ("main", 5 * GiB, "the pod's limit")
    capped = resolve(
        pod({key("main", "gpu-memory.limit"): "12Gi"}),
        namespaces={"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=6 * GiB))},
    )
    assert (capped.limit_bytes, own(capped)) == (6 * GiB, {"main": 6 * GiB})


def test_thousands_of_keys_for_missing_containers_are_counted_not_listed() -> None:
    many = {key(f"c{i}", "gpu-memory.limit"): "1Gi" for i in range(5000)}
    many[key("main", "gpu-memory.limit")] = "4Gi"
    p = pod(many)
    declared = p.declared[LimitSource.KAI]
    assert len(declared.containers) <= 1 + 4
    r = resolve(p)
    assert (r.limit_bytes, own(r)) == (4 * GiB, {"main": 4 * GiB})
    assert any("4996 more container names" in w for w in r.warnings)


# --- the binder's pins and gpu-fraction-num-devices --------------------------------------------


def test_the_binders_pin_scopes_a_container_declaration_and_never_lifts_it_elsewhere() -> None:
    p = pod({key("main", "gpu-memory.limit"): "20Gi", key("main", "gpus.devices"): GPU1.uuid})
    policy: dict[str, Any] = {"cluster_default": LimitValue(limit_bytes=8 * GiB)}
    here = resolve(p, GPU1, **policy)
    assert (here.limit_bytes, here.source, own(here)) == (20 * GiB, LimitSource.KAI,
                                                         {"main": 20 * GiB})  # fmt: skip
    elsewhere = resolve(p, GPU0, **policy)
    # Not assigned GPU 0: the declaration grants nothing there; the admin default holds the pod.
    assert (elsewhere.limit_bytes, elsewhere.source) == (8 * GiB, LimitSource.DEFAULT)
    assert elsewhere.unassigned == (LimitSource.KAI,)
    # A smaller declaration still caps there: a pin (pod metadata) never lifts a declaration.
    small = pod({key("main", "gpu-memory.limit"): "2Gi", key("main", "gpus.devices"): GPU1.uuid})
    assert resolve(small, GPU0, **policy).limit_bytes == 2 * GiB
    assert own(resolve(small, GPU0, **policy)) == {"main": 2 * GiB}


@pytest.mark.parametrize("devices", ["", "not-a-gpu", "x" * 10000, 7, f"{GPU1.uuid},,bad"])
def test_a_malformed_pin_is_reported_and_never_a_way_out(devices: object) -> None:
    p = pod({key("main", "gpu-memory.limit"): "2Gi", key("main", "gpus.devices"): devices})
    r = resolve(p, GPU0, cluster_default=LimitValue(limit_bytes=8 * GiB))
    assert r.limit_bytes == 2 * GiB
    assert own(r) == {"main": 2 * GiB}


def test_the_binders_pin_also_scopes_kais_pod_wide_annotation() -> None:
    p = pod({"gpu-memory": "20000", key("main", "gpus.devices"): f"{GPU1.uuid}"})
    policy: dict[str, Any] = {"cluster_default": LimitValue(limit_bytes=8 * GiB)}
    assert resolve(p, GPU1, **policy).limit_bytes == 20000 * MiB
    assert resolve(p, GPU0, **policy).limit_bytes == 8 * GiB


@pytest.mark.parametrize("count", ["2", "1"])
def test_gpu_fraction_num_devices_holds_each_gpu_to_the_declared_amount(count: str) -> None:
    pins = f"{GPU0.uuid},{GPU1.uuid}"
    p = pod({key("main", "gpu-memory.request"): "6Gi", key("main", "gpus.devices"): pins,
             "gpu-fraction-num-devices": count})  # fmt: skip
    for device in (GPU0, GPU1):
        r = resolve(p, device)
        assert (r.limit_bytes, own(r)) == (6 * GiB, {"main": 6 * GiB})
        assert any("binder pinned 2 devices" in w for w in r.warnings) == (count != "2")


@pytest.mark.parametrize("count", ["0", "-1", "99999", "1e3", "two", 2])
def test_a_malformed_num_devices_is_reported_and_changes_no_limit(count: object) -> None:
    p = pod({key("main", "gpu-memory.limit"): "6Gi", "gpu-fraction-num-devices": count})
    r = resolve(p, GPU0)
    assert (r.limit_bytes, own(r)) == (6 * GiB, {"main": 6 * GiB})
    assert any("gpu-fraction-num-devices" in w for w in r.warnings)


# --- anything a tenant writes -------------------------------------------------------------------

_VALUES = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["4Gi", "2Gi", "0", "1e30", "512Mi", "1Mi", "-1", "NaN", "1.5Gi"]),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_KEYS = st.builds(
    key,
    st.sampled_from(["main", "side", "ghost", "MAIN", "", "main.gpu-memory"]),
    st.sampled_from(["gpu-memory.limit", "gpu-memory.request", "gpus.devices"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.one_of(
            _KEYS, st.sampled_from(["gpu-memory", "gpu-fraction", "gpu-fraction-num-devices"])
        ),
        _VALUES,
        max_size=8,
    )
)
def test_any_annotations_never_raise_never_leave_the_pod_unlimited_or_below_a_mebibyte(
    annotations: dict[str, Any],
) -> None:
    p = pod(annotations)
    for device in (GPU0, GPU1, None):
        r = resolve(p, device, cluster_default=LimitValue(limit_bytes=8 * GiB))
        if r.limit_bytes is None:  # only a declaration above the GPU's memory: never reached
            assert any("effectively unlimited" in w for w in r.warnings)
            assert r.containers == ()
            continue
        assert r.limit_bytes >= MiB
        for c in r.containers:
            assert MiB <= c.limit_bytes <= r.limit_bytes


@pytest.mark.parametrize("weird", ["evil\n\x1b[31m", "x" * 300])
def test_a_key_naming_no_possible_container_is_reported_quoted_and_short(weird: str) -> None:
    r = resolve(pod({key(weird, "gpu-memory.limit"): "1Gi"}))
    (error,) = [e for e in r.errors if "no container" in e]
    assert "\n" not in error
    assert "\x1b" not in error
    assert len(error) < 400
