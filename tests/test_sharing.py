"""core.sharing: the DESIGN §5.3 document, every error and warning class, and desired_labels."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    MigChangePolicy,
    SharingConfig,
    Validation,
    desired_labels,
    parse_sharing,
)

DP = frozenset({"slice-4", "slice-8"})
MIG = frozenset({"all-disabled", "2x2g.10gb-3x1g.5gb"})


def design_example() -> dict[str, Any]:
    """DESIGN §5.3's example document."""
    return {
        "version": "v1",
        "devicePluginConfig": {"namespace": "gpu-operator", "name": "nvidia-time-slicing-config"},
        "migConfig": {
            "namespace": "gpu-operator",
            "name": "nvidia-mig-config",
            "key": "config.yaml",
        },
        "migChangePolicy": "WhenIdle",
        "rules": [
            {
                "name": "t4-shared",
                "nodeSelector": {
                    "matchLabels": {"node.kubernetes.io/instance-type": "g4dn.12xlarge"}
                },
                "timeSlicing": "slice-4",
            },
            {
                "name": "a100-mig",
                "nodeNames": ["gpu-a100-1", "gpu-a100-2"],
                "mig": "2x2g.10gb-3x1g.5gb",
                "timeSlicing": "slice-4",
            },
        ],
    }


def parse(document: Any, *, known: bool = True) -> Validation:
    if known:
        return parse_sharing(document, device_plugin_profiles=DP, mig_profiles=MIG)
    return parse_sharing(document)


def config(document: Any) -> SharingConfig:
    result = parse(document)
    assert result.errors == (), result.errors
    assert result.config is not None
    return result.config


def test_the_design_example_is_valid_without_warnings() -> None:
    result = parse(design_example())
    assert result.valid
    assert result.warnings == ()
    assert result.config is not None
    assert result.config.mig_change_policy is MigChangePolicy.WHEN_IDLE
    assert [r.name for r in result.config.rules] == ["t4-shared", "a100-mig"]


@pytest.mark.parametrize("policy", ["WhenIdle", "Cordon", "Drain", "Force"])
def test_accepts_every_mig_change_policy(policy: str) -> None:
    document = design_example()
    document["migChangePolicy"] = policy
    assert config(document).mig_change_policy.value == policy


def test_the_policy_defaults_to_when_idle_and_the_mig_key_to_config_yaml() -> None:
    document = design_example()
    del document["migChangePolicy"]
    del document["migConfig"]["key"]
    parsed = config(document)
    assert parsed.mig_change_policy is MigChangePolicy.WHEN_IDLE
    assert parsed.mig_config is not None
    assert parsed.mig_config.key == "config.yaml"


def edit(path: str, value: Any) -> dict[str, Any]:
    """The design example with one change: ``rules.0.name`` = value; ``value`` DELETE removes."""
    document = design_example()
    node: Any = document
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return document


DELETE = object()
SELECTOR = "rules.0.nodeSelector"

ERRORS = [
    (edit("version", "v2"), "unknown_version"),
    (edit("version", DELETE), "missing_key"),
    (edit("verzion", "v1"), "unknown_key"),
    (edit("rules.0.timeslicing", "slice-4"), "unknown_key"),
    (edit("migConfig.extra", 1), "unknown_key"),
    (edit("rules.1.name", "t4-shared"), "duplicate_rule_name"),
    (edit("rules.1.name", DELETE), "missing_rule_name"),
    (edit("rules.1.name", ""), "missing_rule_name"),
    (edit("rules.1.name", 7), "invalid_rule_name"),
    (edit("rules.1.name", "a\nb"), "invalid_rule_name"),
    (edit("rules.0.nodeNames", ["n1"]), "selector_and_node_names"),
    (edit(SELECTOR, DELETE), "no_selector_or_node_names"),
    (edit("rules.1.nodeNames", []), "no_selector_or_node_names"),
    (edit("rules.1.nodeNames", ["Not_A_Node"]), "invalid_node_name"),
    (edit("rules.1.nodeNames", "gpu-a100-1"), "wrong_type"),
    (
        edit(SELECTOR, {"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}),
        "invalid_selector_operator",
    ),
    (
        edit(SELECTOR, {"matchExpressions": [{"key": "a", "operator": "In"}]}),
        "invalid_selector_values",
    ),
    (edit(SELECTOR, {"matchLabels": {"a": "not valid!"}}), "invalid_label_value"),
    (edit(SELECTOR, {"matchLabels": {"not valid!": "a"}}), "invalid_label_key"),
    (edit("rules.0.timeSlicing", "slice-5"), "unknown_profile"),
    (edit("rules.1.mig", "all-1g.5gb"), "unknown_profile"),
    (edit("rules.0.timeSlicing", "slice 4"), "invalid_label_value"),
    (edit("rules.0.timeSlicing", "x" * 64), "invalid_label_value"),
    (edit("rules.0.timeSlicing", ""), "invalid_label_value"),
    (edit("rules.1.mig", 4), "invalid_label_value"),
    (edit("rules.0.timeSlicing", DELETE), "empty_rule"),
    (edit("migChangePolicy", "Later"), "invalid_policy"),
    (edit("migChangePolicy", "whenidle"), "invalid_policy"),
    (edit("devicePluginConfig", {"name": "x"}), "missing_key"),
    (edit("devicePluginConfig.namespace", "Bad_NS"), "invalid_name"),
    (edit("migConfig.key", ""), "invalid_name"),
    (edit("rules", {"a": 1}), "wrong_type"),
    (edit("rules.0", "rule"), "wrong_type"),
    (edit("rules", [design_example()["rules"][0]] * 1001), "too_many"),
    (edit("rules.1.nodeNames", [f"n{i}" for i in range(10_001)]), "too_many"),
    (["a list"], "wrong_type"),
]


@pytest.mark.parametrize(("document", "code"), ERRORS)
def test_each_error_class_has_a_code_and_a_path(document: Any, code: str) -> None:
    result = parse(document)
    assert not result.valid
    assert result.config is None
    assert code in {p.code for p in result.errors}, result.errors
    assert all(p.message for p in result.errors)


@pytest.mark.parametrize(
    "key",
    [
        "nvidia.com/gpu.product",
        "nvidia.com/gpu.count",
        "nvidia.com/gpu.memory",
        "nvidia.com/gpu.replicas",
        "nvidia.com/gpu.sharing-strategy",
    ],
)
def test_warns_on_a_selector_over_a_label_sharing_rewrites(key: str) -> None:
    expressions = [{"key": key, "operator": "Exists"}]
    result = parse(edit(SELECTOR, {"matchExpressions": expressions}))
    assert result.valid
    assert [p.code for p in result.warnings] == ["selects_rewritten_label"]
    assert key in result.warnings[0].message


def test_warns_when_profiles_cannot_be_checked() -> None:
    result = parse(design_example(), known=False)
    assert result.valid
    assert [p.code for p in result.warnings] == ["profiles_not_checked"] * 2


def test_warns_when_a_rule_uses_profiles_without_their_source() -> None:
    result = parse(edit("migConfig", DELETE))
    assert result.valid
    assert [(p.code, p.path) for p in result.warnings] == [("no_profile_source", "migConfig")]


def test_reports_every_problem_at_once() -> None:
    document = design_example()
    document["version"] = "v0"
    document["extra"] = True
    document["rules"][1]["name"] = "t4-shared"
    document["rules"][0]["nodeNames"] = ["x"]
    document["rules"][1]["mig"] = "nope"
    codes = sorted(p.code for p in parse(document).errors)
    assert codes == [
        "duplicate_rule_name",
        "selector_and_node_names",
        "unknown_key",
        "unknown_profile",
        "unknown_version",
    ]


def test_problems_are_bounded() -> None:
    rules = [{"name": str(i), "nodeNames": ["BAD"] * 5, "timeSlicing": "x"} for i in range(900)]
    result = parse({"version": "v1", "rules": rules})
    assert len(result.errors) == 1001
    assert result.errors[-1].code == "too_many_problems"


def test_an_empty_rule_list_is_valid_and_changes_nothing() -> None:
    parsed = config({"version": "v1"})
    assert desired_labels({"a": "b"}, "n", parsed) == (None, {})


# ---------------------------------------------------------------------------------------------
# desired_labels


def test_first_matching_rule_wins_and_only_its_keys_are_set() -> None:
    document = design_example()
    document["rules"].append(
        {"name": "everything", "nodeSelector": {}, "mig": "all-disabled"},
    )
    parsed = config(document)
    t4 = {"node.kubernetes.io/instance-type": "g4dn.12xlarge"}
    assert desired_labels(t4, "n1", parsed) == (
        "t4-shared",
        {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4"},
    )
    assert desired_labels({}, "gpu-a100-2", parsed) == (
        "a100-mig",
        {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4", MIG_CONFIG_LABEL: "2x2g.10gb-3x1g.5gb"},
    )
    assert desired_labels({}, "other", parsed) == ("everything", {MIG_CONFIG_LABEL: "all-disabled"})


def test_a_node_no_rule_matches_gets_no_changes() -> None:
    assert desired_labels({"zone": "a"}, "cpu-node", config(design_example())) == (None, {})


_names = st.sampled_from(["n1", "n2", "n3"])
_labels = st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from(["1", "2"]), max_size=2)


@given(
    node_labels=_labels,
    node_name=_names,
    first=st.lists(_names, min_size=1, max_size=3),
)
def test_order_decides_and_node_names_select_exactly_those_nodes(
    node_labels: dict[str, str], node_name: str, first: list[str]
) -> None:
    document = {
        "version": "v1",
        "rules": [
            {"name": "named", "nodeNames": first, "timeSlicing": "slice-4"},
            {"name": "rest", "nodeSelector": {}, "timeSlicing": "slice-8"},
        ],
    }
    rule, labels = desired_labels(node_labels, node_name, config(copy.deepcopy(document)))
    expected = "named" if node_name in first else "rest"
    assert rule == expected
    assert labels == {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4" if expected == "named" else "slice-8"}


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["v1", "In", "Exists", "slice-4", "WhenIdle", "name", "nodeSelector"]),
)
_keys = st.one_of(
    st.sampled_from(
        [
            *"abc",
            "version",
            "rules",
            "name",
            "nodeSelector",
            "nodeNames",
            "timeSlicing",
            "mig",
            "matchLabels",
            "matchExpressions",
            "key",
            "operator",
            "values",
            "migConfig",
        ]
    ),
    st.integers(),
    st.none(),
)
_documents = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=5)),
    max_leaves=30,
)


@given(document=_documents)
def test_any_document_gives_problems_never_an_exception(document: Any) -> None:
    result = parse(document)
    assert (result.config is None) is bool(result.errors)
    for problem in (*result.errors, *result.warnings):
        assert problem.code
        assert "\n" not in str(problem)


@given(rules=st.lists(st.dictionaries(_keys, _documents, max_size=6), max_size=4))
def test_any_rule_list_gives_problems_never_an_exception(rules: list[Any]) -> None:
    result = parse({"version": "v1", "rules": rules})
    assert (result.config is None) is bool(result.errors)
