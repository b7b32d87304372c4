"""Other schedulers' memory declarations (issue 15, DESIGN §5.1): each source's fields read as
that scheduler writes them, valid and invalid values per source, and the precedence between
gpuguard's annotation, the listed sources and the admin defaults, through the one translation
(``pod_from_json``) and the one resolution (``core.limits.resolve_limit``)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuguard.adapters.kube.translate import pod_from_json
from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import LimitPolicy, LimitSource, LimitValue, Pod

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
def test_the_annotation_wins_over_every_source(source: str) -> None:
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


def test_the_first_listed_source_that_declares_wins() -> None:
    p = pod({"gpu-memory": "1000"}, [{"nvidia.com/gpumem": "3000"}])
    assert limit_of(p, sources=("gpuguard", "kai", "hami"))[:2] == (1000 * MiB, "kai")
    assert limit_of(p, sources=("gpuguard", "hami", "kai"))[:2] == (3000 * MiB, "hami")
    # An invalid first source falls through to the next one, not to "unlimited".
    bad_kai = pod({"gpu-memory": "0"}, [{"nvidia.com/gpumem": "3000"}])
    assert limit_of(bad_kai, sources=("kai", "hami"))[:2] == (3000 * MiB, "hami")


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
    from gpuguard.adapters.kube import declared

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
