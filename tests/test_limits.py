"""core.limits: precedence, caps, exemptions and modes (docs/design.md, Limit sources), and
malformed annotations (docs/reliability.md I1–I9) going through the real parser into the real
resolver."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from gpuguard.config import Settings
from gpuguard.core.limits import effective_mode, is_exempt, resolve_limit
from gpuguard.core.model import (
    LIMIT_ANNOTATION,
    Declaration,
    GpuDevice,
    GpuUuid,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Mode,
    NamespacePolicy,
    Pod,
    PodUid,
    ResolvedLimit,
)
from gpuguard.kubemodel.quantity import MAX_BYTES, parse_limit_annotation

GI = 1 << 30
DEVICE = 80 * GI


def pod(annotations: Mapping[str, object] | None = None, namespace: str = "team-a") -> Pod:
    """A pod built the way the kube adapter and check-pod build one: the real parser."""
    annotations = dict(annotations or {})
    limit, error = parse_limit_annotation(annotations)
    return Pod(
        uid=PodUid("0b6f4c5e-1d2a-4c3b-9e8f-7a6b5c4d3e2f"),
        namespace=namespace,
        name="trainer",
        annotations={k: str(v) for k, v in annotations.items()},
        annotation_limit=limit,
        annotation_error=error,
    )


def gib(n: float) -> LimitValue:
    return LimitValue(limit_bytes=int(n * GI))


def resolve(
    p: Pod,
    policy: LimitPolicy | None = None,
    *,
    device: int | None = DEVICE,
    replicas: int | None = None,
) -> ResolvedLimit:
    return resolve_limit(
        pod=p, device_total_bytes=device, policy=policy or LimitPolicy(), replicas=replicas
    )


FULL = LimitPolicy(
    cluster_default=gib(10),
    namespaces={"team-a": NamespacePolicy(default_limit=gib(20))},
    replicas_default=True,
    replicas_reserve_bytes=0,
)


# --- precedence ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "namespace", "replicas", "limit", "source"),
    [
        ({LIMIT_ANNOTATION: "8Gi"}, "team-a", 4, 8 * GI, LimitSource.ANNOTATION),
        ({}, "team-a", 4, 20 * GI, LimitSource.NAMESPACE_DEFAULT),
        ({}, "team-b", 4, 10 * GI, LimitSource.DEFAULT),
        ({LIMIT_ANNOTATION: "25%"}, "team-b", 4, 20 * GI, LimitSource.ANNOTATION),
    ],
)
def test_annotation_beats_namespace_default_beats_cluster_default(
    annotations: dict[str, str], namespace: str, replicas: int, limit: int, source: LimitSource
) -> None:
    got = resolve(pod(annotations, namespace), FULL, replicas=replicas)
    assert (got.limit_bytes, got.source, got.errors) == (limit, source, ())


def test_replicas_default_splits_device_minus_reserve_when_nothing_else_applies() -> None:
    policy = LimitPolicy(replicas_default=True, replicas_reserve_bytes=4 * GI)
    got = resolve(pod(), policy, replicas=4)
    assert (got.limit_bytes, got.source) == (19 * GI, LimitSource.REPLICAS)


def test_replicas_default_rounds_down_to_whole_bytes() -> None:
    policy = LimitPolicy(replicas_default=True)
    got = resolve(pod(), policy, device=10 * GI + 1, replicas=3)
    assert got.limit_bytes == (10 * GI + 1) // 3


@pytest.mark.parametrize(("enabled", "replicas"), [(False, 4), (True, None), (True, 1), (True, 0)])
def test_no_replicas_default_when_disabled_unknown_or_not_time_sliced(
    enabled: bool, replicas: int | None
) -> None:
    got = resolve(pod(), LimitPolicy(replicas_default=enabled), replicas=replicas)
    assert (got.limit_bytes, got.source, got.errors) == (None, None, ())


def test_replicas_default_with_a_reserve_larger_than_the_device_is_an_error_not_a_zero_limit() -> (
    None
):
    policy = LimitPolicy(replicas_default=True, replicas_reserve_bytes=DEVICE)
    got = resolve(pod(), policy, replicas=2)
    assert got.limit_bytes is None
    assert got.source is LimitSource.REPLICAS
    assert "leaves nothing" in got.errors[0]


def test_replicas_default_on_a_device_of_unknown_size_is_an_error() -> None:
    got = resolve(pod(), LimitPolicy(replicas_default=True), device=None, replicas=2)
    assert got.limit_bytes is None
    assert "memory size" in got.errors[0]


def test_no_annotation_and_no_default_means_no_limit() -> None:
    got = resolve(pod(), LimitPolicy())
    assert got == ResolvedLimit(limit_bytes=None, source=None)


# --- maximum: tenants can only tighten (I9) ---------------------------------------------------


def test_namespace_maximum_caps_an_annotation_above_it() -> None:
    policy = LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=gib(16))})
    got = resolve(pod({LIMIT_ANNOTATION: "40Gi"}), policy)
    assert (got.limit_bytes, got.source) == (16 * GI, LimitSource.ANNOTATION)
    assert any("capped to the maximum of namespace team-a" in w for w in got.warnings)


def test_namespace_maximum_leaves_a_lower_annotation_alone() -> None:
    policy = LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=gib(16))})
    got = resolve(pod({LIMIT_ANNOTATION: "8Gi"}), policy)
    assert (got.limit_bytes, got.warnings) == (8 * GI, ())


def test_namespace_maximum_caps_defaults_too() -> None:
    policy = LimitPolicy(
        cluster_default=gib(30), namespaces={"team-a": NamespacePolicy(max_limit=gib(16))}
    )
    got = resolve(pod(), policy)
    assert (got.limit_bytes, got.source) == (16 * GI, LimitSource.DEFAULT)


def test_namespace_maximum_is_the_limit_when_nothing_else_applies() -> None:
    policy = LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=LimitValue(percent=25))})
    got = resolve(pod(), policy)
    assert (got.limit_bytes, got.source) == (20 * GI, LimitSource.NAMESPACE_DEFAULT)
    assert "is the limit" in got.warnings[0]


def test_a_maximum_in_another_namespace_does_not_apply() -> None:
    policy = LimitPolicy(namespaces={"team-b": NamespacePolicy(max_limit=gib(1))})
    assert resolve(pod({LIMIT_ANNOTATION: "8Gi"}), policy).limit_bytes == 8 * GI


def test_a_percentage_maximum_on_an_unknown_device_is_an_error_and_caps_nothing() -> None:
    policy = LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=LimitValue(percent=25))})
    got = resolve(pod({LIMIT_ANNOTATION: "8Gi"}), policy, device=None)
    assert got.limit_bytes == 8 * GI
    assert "memory size" in got.errors[0]


@pytest.mark.parametrize(
    "key", ["gpuguard.io/exempt", "gpuguard.io/max-gpu-memory", "gpuguard.io/mode"]
)
def test_self_exemption_annotations_are_ignored_with_a_warning(key: str) -> None:
    policy = LimitPolicy(cluster_default=gib(10))
    got = resolve(pod({key: "true"}), policy)
    assert (got.limit_bytes, got.source) == (10 * GI, LimitSource.DEFAULT)
    assert got.warnings == (
        f"unknown annotation {key} ignored: the only gpuguard annotation is {LIMIT_ANNOTATION}; "
        "exemptions and maximums come from the admin's config",
    )
    assert is_exempt("team-a", policy, None) is False


# --- device size -------------------------------------------------------------------------------


def test_a_limit_above_the_device_is_effectively_unlimited_with_a_warning() -> None:
    got = resolve(pod({LIMIT_ANNOTATION: "100Gi"}), device=DEVICE)
    assert (got.limit_bytes, got.source) == (None, LimitSource.ANNOTATION)
    assert "effectively unlimited" in got.warnings[0]


def test_a_limit_equal_to_the_device_is_kept() -> None:
    assert resolve(pod({LIMIT_ANNOTATION: "80Gi"})).limit_bytes == DEVICE


def test_a_percentage_with_an_unknown_device_size_is_no_limit_with_an_error() -> None:
    got = resolve(pod({LIMIT_ANNOTATION: "25%"}), device=None)
    assert (got.limit_bytes, got.source) == (None, LimitSource.ANNOTATION)
    assert "needs the device's memory size" in got.errors[0]


def test_a_percentage_resolves_against_each_device_size() -> None:
    p = pod({LIMIT_ANNOTATION: "12.5%"})
    assert resolve(p, device=80 * GI).limit_bytes == 10 * GI
    assert resolve(p, device=24 * GI).limit_bytes == 3 * GI


def test_a_bare_number_is_bytes_and_below_the_minimum_it_is_refused() -> None:
    got = resolve(pod({LIMIT_ANNOTATION: "16"}), LimitPolicy(cluster_default=gib(4)))
    assert (got.limit_bytes, got.source) == (4 * GI, LimitSource.DEFAULT)
    assert "did you mean 16Gi?" in got.errors[0]


# --- nothing resolves below 1 MiB, from any source ------------------------------------------------

TINY_PERCENT = LimitValue(percent=1e-22)


@pytest.mark.parametrize(
    ("annotations", "policy", "device", "replicas", "expected"),
    [
        pytest.param(
            {LIMIT_ANNOTATION: "0.0000000000000000000001%"}, LimitPolicy(), DEVICE, None,
            (None, None), id="annotation-percent-rounds-to-zero",
        ),
        pytest.param(
            {LIMIT_ANNOTATION: "25%"}, LimitPolicy(), 1, None, (None, None),
            id="annotation-percent-of-a-1-byte-device",
        ),
        pytest.param(
            {LIMIT_ANNOTATION: "0.0000000000000000000001%"},
            LimitPolicy(cluster_default=gib(2)), DEVICE, None, (2 * GI, LimitSource.DEFAULT),
            id="falls-through-to-the-default",
        ),
        pytest.param(
            {}, LimitPolicy(cluster_default=TINY_PERCENT), DEVICE, None, (None, None),
            id="cluster-default-percent",
        ),
        pytest.param(
            {},
            LimitPolicy(
                cluster_default=gib(3),
                namespaces={"team-a": NamespacePolicy(default_limit=TINY_PERCENT)},
            ),
            DEVICE, None, (3 * GI, LimitSource.DEFAULT), id="namespace-default-percent",
        ),
        pytest.param(
            {LIMIT_ANNOTATION: "8Gi"},
            LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=TINY_PERCENT)}),
            DEVICE, None, (8 * GI, LimitSource.ANNOTATION), id="namespace-max-percent",
        ),
        pytest.param(
            {}, LimitPolicy(replicas_default=True), 3 << 20, 4, (None, LimitSource.REPLICAS),
            id="replicas-split",
        ),
    ],
)  # fmt: skip
def test_no_source_ever_resolves_to_a_limit_below_one_mebibyte(
    annotations: Mapping[str, object],
    policy: LimitPolicy,
    device: int,
    replicas: int | None,
    expected: tuple[int | None, LimitSource | None],
) -> None:
    got = resolve(pod(annotations), policy, device=device, replicas=replicas)
    assert (got.limit_bytes, got.source) == expected
    assert any("below the smallest limit of 1Mi" in e for e in got.errors), got.errors


# --- declarations cap, the smallest binds, pins scope a declaration to its device -----------------

G0 = GpuDevice(index=0, uuid=GpuUuid("GPU-0a"), name="g", total_bytes=DEVICE)
G1 = GpuDevice(index=1, uuid=GpuUuid("GPU-1b"), name="g", total_bytes=DEVICE)
KAI_8 = {LimitSource.KAI: Declaration(amount=8192, where="annotation gpu-memory")}
HAMI_4_ON_G1 = {
    LimitSource.HAMI: Declaration(amount=4096, where="limits", pinned=frozenset({"GPU-1b"}))
}
HAMI_40_ON_G1 = {
    LimitSource.HAMI: Declaration(amount=40960, where="limits", pinned=frozenset({"GPU-1b"}))
}
SHARE_40_ON_1 = {
    LimitSource.GPUSHARE: Declaration(amount=40, where="limits", pinned=frozenset({"index:1"}))
}
ALL_SOURCES = ("gpuguard", "kai", "hami", "gpushare", "volcano")
DEFAULTS = LimitPolicy(
    sources=ALL_SOURCES,
    cluster_default=gib(10),
    namespaces={"team-a": NamespacePolicy(max_limit=gib(16))},
)
BARE = LimitPolicy(sources=ALL_SOURCES)
ONLY_MAX = LimitPolicy(
    sources=ALL_SOURCES, namespaces={"team-a": NamespacePolicy(max_limit=gib(16))}
)


@pytest.mark.parametrize(
    ("annotations", "declared", "policy", "device", "expected"),
    [
        # Every applicable declaration caps; the smallest binds and names the source.
        pytest.param({LIMIT_ANNOTATION: "100%"}, KAI_8, BARE, G0, (8 * GI, LimitSource.KAI),
                     id="annotation-above-a-declaration-is-capped"),
        pytest.param({LIMIT_ANNOTATION: "2Gi"}, KAI_8, BARE, G0, (2 * GI, LimitSource.ANNOTATION),
                     id="annotation-below-a-declaration-binds"),
        pytest.param({LIMIT_ANNOTATION: "40Gi"}, {}, DEFAULTS, G0,
                     (16 * GI, LimitSource.ANNOTATION), id="the-max-caps-the-annotation"),
        pytest.param({}, KAI_8, DEFAULTS, G0, (8 * GI, LimitSource.KAI),
                     id="a-declaration-is-used-before-the-defaults"),
        # A pin scopes its declaration to its device: on the GPU it names, it applies.
        pytest.param({}, HAMI_40_ON_G1, DEFAULTS, G1, (16 * GI, LimitSource.HAMI),
                     id="pinned-here-capped-by-the-max"),
        pytest.param({}, SHARE_40_ON_1, DEFAULTS, G1, (16 * GI, LimitSource.GPUSHARE),
                     id="pinned-by-index-here"),
        # On another GPU it grants nothing: the next applicable limit holds the pod…
        pytest.param({}, HAMI_40_ON_G1, DEFAULTS, G0, (10 * GI, LimitSource.DEFAULT),
                     id="elsewhere-the-cluster-default"),
        pytest.param({}, SHARE_40_ON_1, DEFAULTS, G0, (10 * GI, LimitSource.DEFAULT),
                     id="elsewhere-by-index-the-cluster-default"),
        pytest.param({LIMIT_ANNOTATION: "6Gi"}, HAMI_40_ON_G1, DEFAULTS, G0,
                     (6 * GI, LimitSource.ANNOTATION), id="elsewhere-the-annotation"),
        pytest.param({}, {**KAI_8, **HAMI_40_ON_G1}, DEFAULTS, G0, (8 * GI, LimitSource.KAI),
                     id="elsewhere-the-next-source"),
        pytest.param({}, HAMI_40_ON_G1, ONLY_MAX, G0, (16 * GI, LimitSource.HAMI),
                     id="elsewhere-the-max-caps-it"),
        # …and it still caps: a pin (tenant-writable) never lifts what the pod declared.
        pytest.param({}, HAMI_4_ON_G1, DEFAULTS, G0, (4 * GI, LimitSource.HAMI),
                     id="elsewhere-a-smaller-declaration-caps-the-default"),
        pytest.param({LIMIT_ANNOTATION: "100%"}, HAMI_4_ON_G1, BARE, G0,
                     (4 * GI, LimitSource.HAMI), id="elsewhere-it-caps-the-annotation"),
        pytest.param({}, HAMI_4_ON_G1, BARE, G0, (4 * GI, LimitSource.HAMI),
                     id="elsewhere-and-nothing-else-applies-never-unlimited"),
        # Without a device (check-pod) every declaration applies, wherever it is pinned.
        pytest.param({}, HAMI_40_ON_G1, DEFAULTS, None, (16 * GI, LimitSource.HAMI),
                     id="no-device"),
    ],
)  # fmt: skip
def test_declarations_cap_the_smallest_binds_and_a_pin_scopes_it_to_its_device(
    annotations: Mapping[str, object],
    declared: Mapping[LimitSource, Declaration],
    policy: LimitPolicy,
    device: GpuDevice | None,
    expected: tuple[int | None, LimitSource | None],
) -> None:
    p = dataclasses.replace(pod(annotations), declared=declared)
    got = resolve_limit(
        pod=p, device_total_bytes=DEVICE, policy=policy, replicas=None, device=device
    )
    assert (got.limit_bytes, got.source) == expected
    assert got.errors == ()
    elsewhere = device is G0 and any(d.pinned for d in declared.values())
    assert bool(got.unassigned) == elsewhere


def test_a_pin_never_makes_a_pod_unlimited_where_a_default_or_max_exists() -> None:
    """Whatever a tenant pins, on whichever GPU: a limit, never above the max."""
    pins = [frozenset(), frozenset({"GPU-0a"}), frozenset({"GPU-1b"}), frozenset({"index:7"})]
    for pinned in pins:
        for device in (G0, G1):
            for policy in (DEFAULTS, ONLY_MAX):
                for amount in (1024, 40960, 1 << 20):
                    declared = {
                        LimitSource.HAMI: Declaration(amount=amount, where="x", pinned=pinned)
                    }
                    p = dataclasses.replace(pod({LIMIT_ANNOTATION: "100%"}), declared=declared)
                    got = resolve_limit(
                        pod=p, device_total_bytes=DEVICE, policy=policy, replicas=None,
                        device=device,
                    )  # fmt: skip
                    assert got.limit_bytes is not None
                    assert got.limit_bytes <= min(16 * GI, amount << 20)


def test_a_pinned_declaration_caps_with_a_warning_that_names_the_pin() -> None:
    p = dataclasses.replace(pod(), declared=HAMI_4_ON_G1)
    got = resolve_limit(pod=p, device_total_bytes=DEVICE, policy=DEFAULTS, replicas=None, device=G0)
    (warning,) = got.warnings
    assert "capped by the hami declaration (limits) 4Gi, pinned to GPU-1b" in warning
    assert "a pin never lifts a declaration" in warning


# --- exemptions and modes --------------------------------------------------------------------


def test_exemptions_come_only_from_the_admin_list() -> None:
    policy = LimitPolicy(exempt_namespaces=frozenset({"kube-system", "gpu-operator"}))
    assert is_exempt("gpu-operator", policy, None)
    assert is_exempt("kube-system", policy, None)
    assert is_exempt("team-a", policy, None) is False
    assert is_exempt("GPU-Operator", policy, None) is False
    # Without an exempt label configured, a namespace's labels never exempt it.
    assert is_exempt("team-a", policy, frozenset({"team-a"})) is False


@pytest.mark.parametrize(
    "name", ["nvidia-device-plugin", "gpu-operator", "nvidia-gpu-operator", "team-a"]
)
def test_by_default_only_kube_system_is_exempt_by_name(name: str) -> None:
    """A tenant who may create namespaces (oc new-project, Capsule, HNC) created
    ``nvidia-device-plugin``, one of the names exempt by default, and its GPU pods were never
    stopped: a name a tenant can create exempts nothing by default."""
    policy = Settings().limit_policy()
    assert is_exempt("kube-system", policy, None)
    assert is_exempt(name, policy, None) is False
    assert is_exempt(name, policy, frozenset()) is False


def test_with_an_exempt_label_a_labelled_namespace_is_exempt_and_unknown_labels_are_unknown() -> (
    None
):
    policy = LimitPolicy(
        exempt_namespaces=frozenset({"kube-system"}),
        exempt_label=("gpuguard.io/exempt", "true"),
    )
    assert is_exempt("gpu-operator", policy, frozenset({"gpu-operator"})) is True
    assert is_exempt("nvidia-device-plugin", policy, frozenset({"gpu-operator"})) is False
    # Labels not known: never "not exempt"; a name the admin listed needs no label.
    assert is_exempt("gpu-operator", policy, None) is None
    assert is_exempt("kube-system", policy, None) is True


@pytest.mark.parametrize(
    ("namespace", "global_mode", "expected"),
    [
        ("onboarding", Mode.ENFORCE, Mode.AUDIT),
        ("strict", Mode.AUDIT, Mode.ENFORCE),
        ("plain", Mode.ENFORCE, Mode.ENFORCE),
        ("plain", Mode.AUDIT, Mode.AUDIT),
        ("unlisted", Mode.ENFORCE, Mode.ENFORCE),
    ],
)
def test_namespace_mode_overrides_the_global_mode(
    namespace: str, global_mode: Mode, expected: Mode
) -> None:
    policy = LimitPolicy(
        namespaces={
            "onboarding": NamespacePolicy(mode=Mode.AUDIT),
            "strict": NamespacePolicy(mode=Mode.ENFORCE),
            "plain": NamespacePolicy(default_limit=gib(1)),
        }
    )
    assert effective_mode(namespace, policy, global_mode) is expected


# --- malformed annotations (docs/reliability.md I1–I9) --------------------------------------------

MALFORMED = [
    # I1 negative
    ("-1Gi", "is negative"),
    # I2 units and spaces
    ("16GB", "unknown unit"),
    ("16gb", "unknown unit"),
    ("16 Gi", "contains whitespace"),
    (" 16Gi ", "contains whitespace"),
    # I4 zero
    ("0", "is zero"),
    ("0Mi", "is zero"),
    # I5 garbage
    ("", "is empty"),
    ("null", "not a number"),
    ('{"gpu":"8Gi"}', "not a number"),
    ("x" * 256 * 1024, "262144 characters"),
    ("１６Gi", "not a number"),
    ("NaN", "not a number"),
    ("eight", "not a number"),
    # percent out of range
    ("101%", "out of range"),
    ("0%", "out of range"),
]


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_a_malformed_annotation_is_an_error_and_the_admin_default_applies(
    text: str, reason: str
) -> None:
    got = resolve(pod({LIMIT_ANNOTATION: text}), FULL)
    assert (got.limit_bytes, got.source) == (20 * GI, LimitSource.NAMESPACE_DEFAULT)
    assert len(got.errors) == 1
    assert got.errors[0].startswith(f"invalid annotation {LIMIT_ANNOTATION}: ")
    assert reason in got.errors[0]
    assert got.errors[0].endswith("ignored (the admin default applies, if any)")


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_a_malformed_annotation_without_any_default_is_no_limit_never_zero(
    text: str, reason: str
) -> None:
    got = resolve(pod({LIMIT_ANNOTATION: text}), LimitPolicy())
    assert got.limit_bytes is None  # never 0, which would kill on the first byte
    assert got.source is None
    assert reason in got.errors[0]


def test_a_malformed_annotation_falls_back_to_the_replicas_default() -> None:
    policy = LimitPolicy(replicas_default=True)
    got = resolve(pod({LIMIT_ANNOTATION: "8GB"}), policy, replicas=4)
    assert (got.limit_bytes, got.source) == (20 * GI, LimitSource.REPLICAS)


@pytest.mark.parametrize("value", [8, None, ["8Gi"], {"a": 1}, True])
def test_a_non_string_annotation_in_a_manifest_is_an_error(value: object) -> None:
    got = resolve(pod({LIMIT_ANNOTATION: value}), FULL)
    assert got.limit_bytes == 20 * GI
    assert "is not a string" in got.errors[0]


@pytest.mark.parametrize("text", ["1Ei", "99999999999999999999Gi", "1e309"])
def test_a_huge_annotation_is_unlimited_on_the_device_and_capped_by_the_admin_max(
    text: str,
) -> None:  # I3
    got = resolve(pod({LIMIT_ANNOTATION: text}))
    assert got.limit_bytes is None
    assert "effectively unlimited" in got.warnings[0]
    capped = resolve(
        pod({LIMIT_ANNOTATION: text}),
        LimitPolicy(namespaces={"team-a": NamespacePolicy(max_limit=gib(16))}),
    )
    assert capped.limit_bytes == 16 * GI
    unknown_device = resolve(pod({LIMIT_ANNOTATION: text}), device=None)
    assert unknown_device.limit_bytes is not None
    assert unknown_device.limit_bytes <= MAX_BYTES


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("gpuguard.io/gpu-memory-limt", "the only gpuguard annotation"),  # I6 typo
        ("gpuguard.io/GPU-Memory-Limit", "keys are case-sensitive"),  # I6 case duplicate
        ("gpuguard.io/gpu-memory-limit.trainer", "per-container limits are not supported"),
        ("gpuguard.io/gpu-memory-limit-trainr", "per-container limits are not supported"),
        ("GPUGuard.io/exempt", "the only gpuguard annotation"),
    ],
)
def test_unknown_gpuguard_annotation_keys_are_warned_about_and_never_applied(
    key: str, hint: str
) -> None:
    got = resolve(pod({key: "1Gi", LIMIT_ANNOTATION: "8Gi"}), FULL)
    assert (got.limit_bytes, got.source) == (8 * GI, LimitSource.ANNOTATION)  # I7 precedence
    assert len(got.warnings) == 1
    assert got.warnings[0].startswith(f"unknown annotation {key} ignored")
    assert hint in got.warnings[0]


def test_a_case_variant_alone_is_not_taken_as_the_limit() -> None:
    got = resolve(pod({"gpuguard.io/GPU-Memory-Limit": "1Gi"}), FULL)
    assert (got.limit_bytes, got.source) == (20 * GI, LimitSource.NAMESPACE_DEFAULT)


def test_other_vendors_annotations_are_not_our_business() -> None:
    got = resolve(pod({"example.com/gpu-memory-limit": "1Gi", "gpuguard.iox/a": "b"}), FULL)
    assert got.warnings == ()


def test_an_annotation_present_but_never_parsed_is_reported_not_silently_dropped() -> None:
    raw = Pod(uid=PodUid("u"), namespace="team-a", name="p", annotations={LIMIT_ANNOTATION: "8Gi"})
    got = resolve(raw, FULL)
    assert got.limit_bytes == 20 * GI
    assert "was not parsed" in got.errors[0]
