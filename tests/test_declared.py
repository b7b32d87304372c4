"""Other schedulers' memory declarations (docs/design.md, Limit sources): each source's fields read
as that scheduler writes them, valid and invalid values per source, and the precedence between
gpuguard's annotation, the listed sources and the admin defaults, through the one translation
(``pod_from_json``) and the one resolution (``core.limits.resolve_limit``)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import GpuDevice, GpuUuid, LimitPolicy, LimitSource, LimitValue, Pod
from gpuguard.kubemodel.translate import pod_from_json

GiB, MiB = 1 << 30, 1 << 20
DEVICE = 80 * GiB
ALL = ("gpuguard", "kai", "hami", "gpushare", "volcano")


def pod(
    annotations: dict[str, Any] | None = None,
    limits: list[dict[str, Any]] | None = None,
    init_limits: list[dict[str, Any]] | None = None,
) -> Pod:
    spec: dict[str, Any] = {
        "containers": [
            {"name": f"c{i}", "resources": {"limits": lim}} for i, lim in enumerate(limits or [])
        ]
    }
    if init_limits:
        spec["initContainers"] = [
            {"name": f"i{i}", "resources": {"limits": lim}} for i, lim in enumerate(init_limits)
        ]
    made = pod_from_json(
        {
            "metadata": {"uid": "u-1", "name": "p", "namespace": "team",
                         "annotations": annotations or {}},
            "spec": spec,
        }
    )  # fmt: skip
    assert made is not None
    return made


def limit_of(
    p: Pod, *, sources: tuple[str, ...] = ALL, **policy: Any
) -> tuple[int | None, str | None, tuple[str, ...]]:
    r = resolve_limit(
        pod=p,
        device_total_bytes=DEVICE,
        policy=LimitPolicy(sources=sources, **policy),
        replicas=None,
    )
    return r.limit_bytes, None if r.source is None else str(r.source), r.errors


# --- each source: valid values and their units -----------------------------------------------


@pytest.mark.parametrize(
    ("p", "limit", "source"),
    [
        pytest.param(pod({"gpu-memory": "2000"}), 2000 * MiB, "kai", id="kai gpu-memory MiB"),
        pytest.param(pod({"gpu-fraction": "0.5"}), DEVICE // 2, "kai", id="kai gpu-fraction"),
        pytest.param(pod({"gpu-fraction": "1"}), DEVICE, "kai", id="kai whole GPU"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem": "3000"}]), 3000 * MiB, "hami",
                     id="hami gpumem MiB"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem": "3k"}]), 3000 * MiB, "hami",
                     id="hami gpumem as the API server writes it"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem": "1000"}, {"nvidia.com/gpumem": "2000"}]),
                     3000 * MiB, "hami", id="hami summed over containers"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem-percentage": "25"}]), DEVICE // 4, "hami",
                     id="hami percentage"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem": "1024"},
                                 {"nvidia.com/gpumem-percentage": "25"}]),
                     GiB + DEVICE // 4, "hami", id="hami MiB and percentage on two containers"),
        pytest.param(pod(limits=[{"aliyun.com/gpu-mem": "3"}]), 3 * GiB, "gpushare",
                     id="gpushare GiB"),
        pytest.param(pod(limits=[{"nvidia.com/gpumem": 3000}]), 3000 * MiB, "hami",
                     id="hami as a YAML number in a manifest"),
        pytest.param(pod(limits=[{"volcano.sh/vgpu-memory": "4096"}]), 4 * GiB, "volcano",
                     id="volcano MiB"),
        pytest.param(pod(limits=[{"volcano.sh/vgpu-memory-percentage": "50"}]), DEVICE // 2,
                     "volcano", id="volcano percentage"),
    ],
)  # fmt: skip
def test_each_source_is_read_in_its_own_units(p: Pod, limit: int, source: str) -> None:
    got, src, errors = limit_of(p)
    assert (got, src, errors) == (limit, source, ())


def test_gpushare_in_mib_where_the_admin_says_so() -> None:
    p = pod(limits=[{"aliyun.com/gpu-mem": "3000"}])
    assert limit_of(p, gpushare_unit_bytes=MiB)[:2] == (3000 * MiB, "gpushare")


# --- invalid values: an error, never unlimited, the admin default applies ------------------------

INVALID = [
    pytest.param({"gpu-memory": "0"}, None, "kai", id="kai zero"),
    pytest.param({"gpu-memory": "-5"}, None, "kai", id="kai negative"),
    pytest.param({"gpu-memory": "2Gi"}, None, "kai", id="kai bytes unit"),
    pytest.param({"gpu-memory": "1.5"}, None, "kai", id="kai fraction of a MiB"),
    pytest.param({"gpu-memory": "lots"}, None, "kai", id="kai non-numeric"),
    pytest.param({"gpu-memory": "1" * 200}, None, "kai", id="kai 200 characters"),
    pytest.param({"gpu-fraction": "0"}, None, "kai", id="kai fraction zero"),
    pytest.param({"gpu-fraction": "1.5"}, None, "kai", id="kai fraction above 1"),
    pytest.param({"gpu-fraction": "50%"}, None, "kai", id="kai fraction as a percentage"),
    pytest.param({"gpu-memory": "2000", "gpu-fraction": "0.5"}, None, "kai", id="kai both"),
    pytest.param(None, [{"nvidia.com/gpumem": "0"}], "hami", id="hami zero"),
    pytest.param(None, [{"nvidia.com/gpumem": "3.5"}], "hami", id="hami fractional"),
    pytest.param(None, [{"nvidia.com/gpumem-percentage": "101"}], "hami",
                 id="hami percentage above 100"),
    pytest.param(None, [{"nvidia.com/gpumem-percentage": "60"},
                        {"nvidia.com/gpumem-percentage": "60"}], "hami",
                 id="hami percentages summing above 100"),
    pytest.param(None, [{"nvidia.com/gpumem": "1000", "nvidia.com/gpumem-percentage": "10"}],
                 "hami", id="hami both on one container"),
    pytest.param(None, [{"nvidia.com/gpumem": True}], "hami", id="hami a boolean"),
    pytest.param(None, [{"nvidia.com/gpumem": 3000.5}], "hami", id="hami a YAML fraction"),
    pytest.param({"gpu-memory": 2000}, None, "kai", id="kai annotation not a string"),
    pytest.param(None, [{"aliyun.com/gpu-mem": "-1"}], "gpushare", id="gpushare negative"),
    pytest.param(None, [{"aliyun.com/gpu-mem": "x"}], "gpushare", id="gpushare non-numeric"),
    pytest.param(None, [{"volcano.sh/vgpu-memory-percentage": "0"}], "volcano",
                 id="volcano percentage zero"),
    pytest.param(None, [{"volcano.sh/vgpu-memory": "1e30"}], "volcano", id="volcano huge"),
]  # fmt: skip


@pytest.mark.parametrize(("annotations", "limits", "source"), INVALID)
def test_an_invalid_declaration_is_an_error_and_the_admin_default_applies(
    annotations: dict[str, Any] | None, limits: list[dict[str, Any]] | None, source: str
) -> None:
    p = pod(annotations, limits)
    assert p.declared[LimitSource(source)].error
    got, src, errors = limit_of(p, cluster_default=LimitValue(limit_bytes=5 * GiB))
    assert (got, src) == (5 * GiB, "default"), "an invalid value must never be a limit"
    assert any(f"invalid {source} declaration" in e for e in errors)
    # And without a default: no limit, with the error, never a limit from the bad value.
    assert limit_of(p)[:2] == (None, None)


def test_a_value_on_an_init_container_is_not_counted_and_says_so() -> None:
    p = pod(limits=[{"nvidia.com/gpumem": "1000"}], init_limits=[{"nvidia.com/gpumem": "9000"}])
    r = resolve_limit(
        pod=p, device_total_bytes=DEVICE, policy=LimitPolicy(sources=ALL), replicas=None
    )
    assert r.limit_bytes == 1000 * MiB
    assert any("init container" in w for w in r.warnings)
    only_init = pod(init_limits=[{"nvidia.com/gpumem": "9000"}])
    assert limit_of(only_init)[:2] == (None, None)


# --- precedence --------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["kai", "hami", "gpushare", "volcano"])
def test_a_smaller_own_annotation_binds_over_every_source(source: str) -> None:
    by_source: dict[str, dict[str, Any]] = {
        "kai": {"annotations": {"gpu-memory": "8000"}},
        "hami": {"limits": [{"nvidia.com/gpumem": "8000"}]},
        "gpushare": {"limits": [{"aliyun.com/gpu-mem": "8"}]},
        "volcano": {"limits": [{"volcano.sh/vgpu-memory": "8000"}]},
    }
    fields = by_source[source]
    annotations = {"gpuguard.io/gpu-memory-limit": "2Gi", **fields.get("annotations", {})}
    p = pod(annotations, fields.get("limits"))
    assert limit_of(p)[:2] == (2 * GiB, "annotation")
    # Without the annotation, the source applies; without the source listed, nothing does.
    q = pod(fields.get("annotations"), fields.get("limits"))
    assert limit_of(q)[1] == source
    assert limit_of(q, sources=("gpuguard",))[:2] == (None, None)


def test_the_smallest_applicable_declaration_binds_whatever_the_order() -> None:
    p = pod({"gpu-memory": "1000"}, [{"nvidia.com/gpumem": "3000"}])
    assert limit_of(p, sources=("gpuguard", "kai", "hami"))[:2] == (1000 * MiB, "kai")
    assert limit_of(p, sources=("gpuguard", "hami", "kai"))[:2] == (1000 * MiB, "kai")
    # The order only names the source on a tie.
    tie = pod({"gpu-memory": "3000"}, [{"nvidia.com/gpumem": "3000"}])
    assert limit_of(tie, sources=("kai", "hami"))[:2] == (3000 * MiB, "kai")
    assert limit_of(tie, sources=("hami", "kai"))[:2] == (3000 * MiB, "hami")
    # An invalid source falls through to the next one, not to "unlimited".
    bad_kai = pod({"gpu-memory": "0"}, [{"nvidia.com/gpumem": "3000"}])
    assert limit_of(bad_kai, sources=("kai", "hami"))[:2] == (3000 * MiB, "hami")


# An escape through the most lenient source: with sources = ["gpuguard", "kai"], gpu-fraction "0.1"
# and the pod's own annotation "100%" gave 100 %, no warning. The tenant's annotation must not raise
# what the scheduler packed the GPU by.
LENIENT = [
    pytest.param({"gpu-fraction": "0.1"}, None, DEVICE // 10, "kai", id="kai fraction"),
    pytest.param({"gpu-memory": "8192"}, None, 8 * GiB, "kai", id="kai MiB"),
    pytest.param(None, [{"nvidia.com/gpumem": "8192"}], 8 * GiB, "hami", id="hami MiB"),
    pytest.param(None, [{"nvidia.com/gpumem-percentage": "10"}], DEVICE // 10, "hami",
                 id="hami percentage"),
    pytest.param(None, [{"aliyun.com/gpu-mem": "8"}], 8 * GiB, "gpushare", id="gpushare"),
    pytest.param(None, [{"volcano.sh/vgpu-memory": "8192"}], 8 * GiB, "volcano", id="volcano"),
]  # fmt: skip


@pytest.mark.parametrize(("annotations", "limits", "limit", "source"), LENIENT)
@pytest.mark.parametrize("own", ["100%", "80Gi", "40Gi", "9Gi"])
def test_a_tenants_own_annotation_never_raises_a_schedulers_declaration(
    annotations: dict[str, Any] | None,
    limits: list[dict[str, Any]] | None,
    limit: int,
    source: str,
    own: str,
) -> None:
    p = pod({"gpuguard.io/gpu-memory-limit": own, **(annotations or {})}, limits)
    r = resolve_limit(
        pod=p, device_total_bytes=DEVICE, policy=LimitPolicy(sources=ALL), replicas=None
    )
    assert (r.limit_bytes, str(r.source), r.errors) == (limit, source, ())
    (capped,) = [w for w in r.warnings if "capped by" in w]
    assert capped.startswith(f"annotation gpuguard.io/gpu-memory-limit {own} (")
    assert f"capped by the {source} declaration" in capped
    assert "never raises what a scheduler declared" in capped
    # Listed in any order: the same limit (the order is no precedence any more).
    backwards = LimitPolicy(sources=tuple(reversed(ALL)))
    again = resolve_limit(pod=p, device_total_bytes=DEVICE, policy=backwards, replicas=None)
    assert (again.limit_bytes, str(again.source)) == (limit, source)


def test_a_smaller_own_annotation_still_tightens_a_declaration() -> None:
    p = pod({"gpuguard.io/gpu-memory-limit": "2Gi", "gpu-fraction": "0.5"})
    r = resolve_limit(
        pod=p, device_total_bytes=DEVICE, policy=LimitPolicy(sources=ALL), replicas=None
    )
    assert (r.limit_bytes, r.source) == (2 * GiB, LimitSource.ANNOTATION)
    assert any("capped by the annotation gpuguard.io/gpu-memory-limit 2Gi" in w for w in r.warnings)


def test_every_declaration_seen_is_listed_with_its_bytes_in_sources_order() -> None:
    p = pod(
        {"gpuguard.io/gpu-memory-limit": "100%", "gpu-fraction": "0.1"},
        [{"nvidia.com/gpumem": "3000"}],
    )
    r = resolve_limit(
        pod=p, device_total_bytes=DEVICE, policy=LimitPolicy(sources=ALL), replicas=None
    )
    assert [(str(d.source), d.value, d.limit_bytes, d.assigned) for d in r.declarations] == [
        ("annotation", "100%", DEVICE, True),
        ("kai", "10%", DEVICE // 10, True),
        ("hami", "3000Mi", 3000 * MiB, True),
    ]
    assert (r.limit_bytes, r.source) == (3000 * MiB, LimitSource.HAMI)


def test_without_the_device_size_the_smallest_known_declaration_holds_the_pod() -> None:
    p = pod({"gpuguard.io/gpu-memory-limit": "8Gi", "gpu-fraction": "0.1"})
    r = resolve_limit(
        pod=p, device_total_bytes=None, policy=LimitPolicy(sources=ALL), replicas=None
    )
    # 10 % may be less than 8Gi, never more than the smallest: 8Gi bounds the true limit.
    assert (r.limit_bytes, r.source) == (8 * GiB, LimitSource.ANNOTATION)
    assert any("kai declaration (annotation gpu-fraction) 10% needs the device" in e
               for e in r.errors)  # fmt: skip
    assert any("smallest declaration cannot be known" in e and "8Gi" in e for e in r.errors)


# An escape through a self-written pin: a pod that writes HAMi's or gpushare's pin itself, naming a
# GPU it does not use, was "on an unassigned device" on the GPU it does use: reported, never
# limited, and the namespace max did not apply.
GPU0 = GpuDevice(index=0, uuid=GpuUuid("GPU-00000000-aaaa-bbbb-cccc-000000000000"), name="g",
                 total_bytes=DEVICE)  # fmt: skip
GPU1 = GpuDevice(index=1, uuid=GpuUuid("GPU-11111111-aaaa-bbbb-cccc-111111111111"), name="g",
                 total_bytes=DEVICE)  # fmt: skip
FORGED = [
    pytest.param({"hami.io/vgpu-devices-allocated": f"{GPU1.uuid},NVIDIA,40000,0:;"},
                 [{"nvidia.com/gpumem": "40000"}], "hami", id="hami pin"),
    pytest.param({"ALIYUN_COM_GPU_MEM_IDX": "1"}, [{"aliyun.com/gpu-mem": "39"}], "gpushare",
                 id="gpushare index"),
]  # fmt: skip


@pytest.mark.parametrize(("annotations", "limits", "source"), FORGED)
def test_a_pin_naming_another_gpu_falls_through_to_the_defaults_and_the_max_there(
    annotations: dict[str, Any], limits: list[dict[str, Any]], source: str
) -> None:
    from gpuguard.core.model import NamespacePolicy

    p = pod(annotations, limits)
    policy = LimitPolicy(
        sources=("gpuguard", "hami", "gpushare"),
        cluster_default=LimitValue(limit_bytes=8 * GiB),
        namespaces={"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=16 * GiB))},
    )

    def on(device: GpuDevice, policy: LimitPolicy = policy) -> tuple[int | None, str | None]:
        r = resolve_limit(
            pod=p, device_total_bytes=DEVICE, policy=policy, replicas=None, device=device
        )
        assert r.unassigned == ((LimitSource(source),) if device is GPU0 else ())
        return r.limit_bytes, None if r.source is None else str(r.source)

    # GPU 0, the one it uses: the declaration grants nothing there; the cluster default holds.
    assert on(GPU0) == (8 * GiB, "default")
    # GPU 1, the one it names: its declaration (39 GiB), capped by the namespace max.
    assert on(GPU1) == (16 * GiB, source)
    # No default: the namespace max still holds on GPU 0 (never "unlimited").
    only_max = LimitPolicy(
        sources=policy.sources,
        namespaces={"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=16 * GiB))},
    )
    assert on(GPU0, only_max) == (16 * GiB, source)


def test_a_source_declaration_beats_the_admin_defaults_and_the_namespace_maximum_caps_it() -> None:
    from gpuguard.core.model import NamespacePolicy

    p = pod({"gpu-memory": "40000"})
    policy: dict[str, Any] = {
        "cluster_default": LimitValue(limit_bytes=4 * GiB),
        "namespaces": {"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=16 * GiB))},
    }
    assert limit_of(p, **policy)[:2] == (16 * GiB, "kai")


def test_pinned_devices_are_read_from_gpushare_and_hami_annotations() -> None:
    share = pod({"ALIYUN_COM_GPU_MEM_IDX": "1"}, [{"aliyun.com/gpu-mem": "3"}])
    assert share.declared[LimitSource.GPUSHARE].pinned == frozenset({"index:1"})
    uuid = "GPU-11111111-2222-3333-4444-555555555555"
    hami = pod(
        {"hami.io/vgpu-devices-allocated": f"{uuid},NVIDIA,3000,0:;"},
        [{"nvidia.com/gpumem": "3000"}],
    )
    assert hami.declared[LimitSource.HAMI].pinned == frozenset({uuid})
    junk = pod({"hami.io/vgpu-devices-allocated": "x" * 10000}, [{"nvidia.com/gpumem": "3"}])
    assert junk.declared[LimitSource.HAMI].pinned == frozenset()


def test_the_readmes_table_of_limit_sources_matches_the_code() -> None:
    """The README's table names every source `limits.sources` accepts, and only those."""
    import re
    from pathlib import Path

    from gpuguard.core.model import FOREIGN_SOURCES, GPUGUARD_SOURCE

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Limit sources", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z]+)` \|", section, re.M)
    assert rows == [GPUGUARD_SOURCE, *(s.value for s in FOREIGN_SOURCES)]
    from gpuguard.kubemodel import declared

    for key in (
        declared.KAI_MEMORY,
        declared.KAI_FRACTION,
        declared.HAMI_MEMORY,
        declared.HAMI_PERCENT,
        declared.HAMI_ALLOCATED,
        declared.GPUSHARE_MEMORY,
        declared.GPUSHARE_INDEX,
        declared.VOLCANO_MEMORY,
        declared.VOLCANO_PERCENT,
    ):
        assert f"`{key}`" in section, key
