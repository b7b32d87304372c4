"""core.sharing: the sharing config document (docs/design.md, Sharing config), every error and
warning class, and desired_labels."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    HeldLabel,
    MigChangePolicy,
    MissingConfig,
    NodeLabels,
    SharingConfig,
    Validation,
    desired_labels,
    match_node,
    parse_sharing,
)
from tests.helpers.documents import nested_documents

DP = frozenset({"slice-4", "slice-8"})
MIG = frozenset({"all-disabled", "2x2g.10gb-3x1g.5gb"})


def design_example() -> dict[str, Any]:
    """The example document of docs/design.md, Sharing config."""
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


# Labels the agent writes from the rules themselves, and labels NVIDIA's mig-manager writes while
# it applies the mig label (NVIDIA/mig-parted pkg/mig/reconfigure/reconfigure.go), spelled out
# here independently of the code.
OWN_OUTPUT = [
    "nvidia.com/device-plugin.config",
    "nvidia.com/mig.config",
    "nvidia.com/mig.config.state",
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.gpu-feature-discovery",
    "nvidia.com/gpu.deploy.dcgm-exporter",
    "nvidia.com/gpu.deploy.dcgm",
    "nvidia.com/gpu.deploy.nvsm",
    "nvidia.com/gpu.deploy.client",
]


def self_selecting(key: str, spelling: str) -> tuple[Any, str]:
    """A selector over ``key`` in one spelling, and the path its error names."""
    base = "rules[0].nodeSelector"
    if spelling == "matchLabels":
        return {"matchLabels": {key: "slice-4"}}, f"{base}.matchLabels.{key}"
    operator = spelling
    values = {"values": ["slice-4", "all-1g.10gb"]} if operator in ("In", "NotIn") else {}
    other = {"key": "node.kubernetes.io/instance-type", "operator": "Exists"}
    expressions = [other, {"key": key, "operator": operator, **values}]
    return {"matchExpressions": expressions}, f"{base}.matchExpressions[1]"


SPELLINGS = ["matchLabels", "In", "NotIn", "Exists", "DoesNotExist"]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("key", OWN_OUTPUT)
def test_a_selector_over_a_label_sharing_writes_is_an_error(key: str, spelling: str) -> None:
    """Such a rule selects on its own output: applied, it moves the node to another rule (or out
    of its own) and back, a Node write, an Event and for the mig label a re-partition every
    turn. It used to be valid without a warning."""
    selector, path = self_selecting(key, spelling)
    result = parse(edit(SELECTOR, selector))
    assert not result.valid
    assert result.config is None
    errors = [p for p in result.errors if p.code == "selects_own_output"]
    assert [p.path for p in errors] == [path], result.errors
    message = errors[0].message
    assert "'t4-shared'" in message  # the rule
    assert key in message
    assert "own output" in message  # why
    assert "flips" in message
    assert "nodeNames" in message  # the fix
    assert "node.kubernetes.io/instance-type" in message
    writer = (
        "gpuguard's agent"
        if key in (DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL)
        else ("mig-manager")
    )
    assert writer in message


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize(
    "key",
    [
        "node.kubernetes.io/instance-type",
        "nvidia.com/gpu.family",
        "nvidia.com/gpu.present",
        "nvidia.com/mig.capable",
        "nvidia.com/device-plugin.configs",  # a near miss is another label
        "nvidia.com/gpu.deploy",
        "example.com/mig.config",
        "pool",
    ],
)
def test_a_selector_over_labels_sharing_does_not_write_stays_valid(key: str, spelling: str) -> None:
    selector, _ = self_selecting(key, spelling)
    result = parse(edit(SELECTOR, selector))
    assert result.valid, result.errors
    assert result.warnings == ()


def test_every_self_selecting_requirement_of_every_rule_is_reported_at_once() -> None:
    document = design_example()
    document["rules"].append(
        {
            "name": "chain",
            "nodeSelector": {
                "matchLabels": {MIG_CONFIG_LABEL: "all-disabled", "pool": "a"},
                "matchExpressions": [
                    {"key": "nvidia.com/mig.config.state", "operator": "In", "values": ["success"]}
                ],
            },
            "timeSlicing": "slice-8",
        }
    )
    document["rules"][0]["nodeSelector"]["matchLabels"][DEVICE_PLUGIN_CONFIG_LABEL] = "slice-4"
    result = parse(document)
    assert sorted(p.path for p in result.errors if p.code == "selects_own_output") == [
        "rules[0].nodeSelector.matchLabels.nvidia.com/device-plugin.config",
        "rules[2].nodeSelector.matchExpressions[0]",
        "rules[2].nodeSelector.matchLabels.nvidia.com/mig.config",
    ]


def test_node_names_and_the_rewritten_label_warning_are_unchanged() -> None:
    """Naming the nodes is the fix; a selector on a label feature discovery rewrites stays a
    warning (no error), as before."""
    assert parse(design_example()).valid
    expressions = [{"key": "nvidia.com/gpu.product", "operator": "Exists"}]
    result = parse(edit(SELECTOR, {"matchExpressions": expressions}))
    assert result.valid
    assert [p.code for p in result.warnings] == ["selects_rewritten_label"]


# Every spelling of a selector with no requirement: Kubernetes selects every node with it.
MATCH_ALL = [
    ({}, "{}"),
    ({"matchLabels": None}, "{matchLabels: null}"),
    ({"matchLabels": {}}, "{matchLabels: {}}"),
    ({"matchExpressions": []}, "{matchExpressions: []}"),
    ({"matchExpressions": None}, "{matchExpressions: null}"),
    (
        {"matchLabels": None, "matchExpressions": None},
        "{matchLabels: null, matchExpressions: null}",
    ),
    ({"matchLabels": {}, "matchExpressions": []}, "{matchLabels: {}, matchExpressions: []}"),
    ({"matchLabels": {}, "matchExpressions": None}, "{matchLabels: {}, matchExpressions: null}"),
    ({"matchLabels": None, "matchExpressions": []}, "{matchLabels: null, matchExpressions: []}"),
]


def catch_all(selector: Any, *, policy: str = "Force", last: bool = True, **sets: str) -> Any:
    """The design example with a rule ``all-gpus`` over ``selector`` (last, or first)."""
    document = design_example()
    document["migChangePolicy"] = policy
    rule = {"name": "all-gpus", "nodeSelector": selector, **(sets or {"mig": "all-disabled"})}
    document["rules"].insert(len(document["rules"]) if last else 0, rule)
    return document


def every_node_warnings(result: Validation) -> list[str]:
    return [p.message for p in result.warnings if p.code == "selects_every_node"]


@pytest.mark.parametrize(("selector", "spelling"), MATCH_ALL)
def test_a_selector_with_no_requirement_is_valid_but_warns_that_it_selects_every_node(
    selector: Any, spelling: str
) -> None:
    result = parse(catch_all(selector))
    assert result.valid
    assert result.config is not None
    assert desired_labels({"any": "node"}, "any-node", result.config)[0] == "all-gpus"
    assert [(p.code, p.path) for p in result.warnings] == [
        ("selects_every_node", "rules[2].nodeSelector")
    ]
    message = result.warnings[0].message
    assert message.startswith(f"rule 'all-gpus': nodeSelector {spelling} has no requirement")
    assert "matches every node" in message
    assert "migChangePolicy Force" in message
    assert "never match" not in message  # the last rule hides nothing
    assert "nodes given" not in message  # no nodes given, nothing counted


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("Force", "with migChangePolicy Force every matching node's MIG layout is changed to "
         "'all-disabled' at once, under its running GPU pods"),
        ("Drain", "with migChangePolicy Drain every matching node is cordoned and its GPU pods "
         "evicted at the same time"),
        ("Cordon", "with migChangePolicy Cordon every matching node is cordoned at the same time "
         "until its GPU pods finish"),
        ("WhenIdle", "with migChangePolicy WhenIdle every matching node's MIG layout is changed to "
         "'all-disabled' as soon as it has no GPU pod"),
    ],
)  # fmt: skip
def test_the_every_node_warning_says_what_the_policy_in_force_does_with_a_mig_rule(
    policy: str, says: str
) -> None:
    (message,) = every_node_warnings(parse(catch_all({}, policy=policy)))
    assert says in message
    assert "timeSlicing" not in message


@pytest.mark.parametrize("policy", ["Force", "Drain", "Cordon", "WhenIdle"])
def test_the_every_node_warning_says_time_slicing_is_not_held_back_by_the_policy(
    policy: str,
) -> None:
    (message,) = every_node_warnings(parse(catch_all({}, policy=policy, timeSlicing="slice-8")))
    assert "device plugin switches to timeSlicing 'slice-8' at once" in message
    assert "migChangePolicy does not hold that back" in message
    assert "MIG layout" not in message
    assert "cordoned" not in message


def test_the_every_node_warning_names_both_changes_of_a_rule_that_sets_both() -> None:
    document = catch_all({}, policy="Drain", timeSlicing="slice-8", mig="all-disabled")
    (message,) = every_node_warnings(parse(document))
    assert "timeSlicing 'slice-8' at once" in message
    assert "migChangePolicy Drain every matching node is cordoned" in message


def test_a_rule_that_selects_every_node_before_others_says_they_never_match() -> None:
    (message,) = every_node_warnings(parse(catch_all({}, last=False)))
    assert "the rules after it never match ('t4-shared', 'a100-mig')" in message


NODES = [
    NodeLabels(name="t4-1", labels={"node.kubernetes.io/instance-type": "g4dn.12xlarge"}),
    NodeLabels(name="gpu-a100-1", labels={}),
    NodeLabels(name="gpu-h100-1", labels={"nvidia.com/gpu.family": "hopper"}),
]


def test_with_nodes_the_every_node_warning_counts_the_nodes_the_rule_gets() -> None:
    first = parse_sharing(
        catch_all({}, last=False), device_plugin_profiles=DP, mig_profiles=MIG, nodes=NODES
    )
    assert "matches every node (3 of the 3 nodes given)" in every_node_warnings(first)[0]
    last = parse_sharing(catch_all({}), device_plugin_profiles=DP, mig_profiles=MIG, nodes=NODES)
    assert (
        "matches every node (1 of the 3 nodes given; earlier rules take the other 2)"
        in every_node_warnings(last)[0]
    )


def test_an_invalid_config_counts_every_node_but_not_which_rule_would_win() -> None:
    document = catch_all({})
    document["rules"][0]["timeSlicing"] = "no-such-profile"
    result = parse_sharing(document, device_plugin_profiles=DP, mig_profiles=MIG, nodes=NODES)
    assert not result.valid
    assert "matches every node (all 3 nodes given)" in every_node_warnings(result)[0]


@pytest.mark.parametrize(
    "selector",
    [
        {"matchLabels": {"node.kubernetes.io/instance-type": "g4dn.12xlarge"}},
        {"matchExpressions": [{"key": "gpuguard.io/typo", "operator": "DoesNotExist"}]},
        {"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["cpu"]}]},
        {"matchLabels": {}, "matchExpressions": [{"key": "pool", "operator": "Exists"}]},
    ],
)
def test_a_selector_with_any_requirement_is_not_called_match_all(selector: Any) -> None:
    assert every_node_warnings(parse(catch_all(selector))) == []


def test_empty_node_names_stay_an_error_they_select_nothing() -> None:
    result = parse(edit("rules.1.nodeNames", []))
    assert not result.valid
    assert [(p.code, p.path) for p in result.errors] == [
        ("no_selector_or_node_names", "rules[1].nodeNames")
    ]
    assert "selects nothing" in result.errors[0].message


def test_warns_when_profiles_cannot_be_checked() -> None:
    result = parse(design_example(), known=False)
    assert result.valid
    assert [p.code for p in result.warnings] == ["profiles_not_checked"] * 2


def test_warns_when_a_rule_uses_profiles_without_their_source() -> None:
    result = parse(edit("migConfig", DELETE))
    assert result.valid
    assert [(p.code, p.path) for p in result.warnings] == [("no_profile_source", "migConfig")]


MIG_MISSING = MissingConfig(
    code="config_map_missing", detail="configmap gpu-operator/nvidia-mig-config is not found"
)


def test_a_missing_config_map_holds_only_the_labels_of_the_rules_that_need_it() -> None:
    """The same config serves a cluster without NVIDIA's MIG manager; its
    time-slicing still applies, each rule's mig is held and named in a warning."""
    result = parse_sharing(
        design_example(), device_plugin_profiles=DP, missing={"migConfig": MIG_MISSING}
    )
    assert result.valid
    assert [(p.code, p.path) for p in result.warnings] == [("config_map_missing", "rules[1].mig")]
    assert "rule 'a100-mig' sets mig '2x2g.10gb-3x1g.5gb'" in result.warnings[0].message
    assert "is not found" in result.warnings[0].message
    assert result.config is not None
    assert result.config.unavailable == {MIG_CONFIG_LABEL: MIG_MISSING}
    t4 = {"node.kubernetes.io/instance-type": "g4dn.12xlarge"}
    assert match_node(t4, "n1", result.config) == match_node(t4, "n1", config(design_example()))
    a100 = match_node({}, "gpu-a100-1", result.config)
    assert a100.rule == "a100-mig"
    assert a100.labels == {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4"}
    assert a100.held == {
        MIG_CONFIG_LABEL: HeldLabel(
            value="2x2g.10gb-3x1g.5gb",
            reason="rule 'a100-mig' sets mig '2x2g.10gb-3x1g.5gb', but configmap "
            "gpu-operator/nvidia-mig-config is not found (config_map_missing)",
        )
    }
    assert desired_labels({}, "gpu-a100-1", result.config) == (
        "a100-mig",
        {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4"},
    )


def test_a_missing_config_map_no_rule_needs_changes_nothing() -> None:
    document = design_example()
    del document["rules"][1]["mig"]
    result = parse_sharing(document, device_plugin_profiles=DP, missing={"migConfig": MIG_MISSING})
    assert result.valid
    assert [(p.code, p.path) for p in result.warnings] == [("config_map_missing", "migConfig")]
    assert "no rule needs it" in result.warnings[0].message
    assert result.config is not None
    for labels, name in (
        ({}, "gpu-a100-1"),
        ({"node.kubernetes.io/instance-type": "g4dn.12xlarge"}, "n"),
    ):
        assert match_node(labels, name, result.config).held == {}
    assert desired_labels({}, "gpu-a100-1", result.config) == (
        "a100-mig",
        {DEVICE_PLUGIN_CONFIG_LABEL: "slice-4"},
    )


def test_a_missing_config_map_does_not_hide_an_error_elsewhere() -> None:
    document = design_example()
    document["rules"][0]["timeSlicing"] = "slice-16"
    result = parse_sharing(document, device_plugin_profiles=DP, missing={"migConfig": MIG_MISSING})
    assert [(p.code, p.path) for p in result.errors] == [
        ("unknown_profile", "rules[0].timeSlicing")
    ]
    assert result.config is None


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
_documents = nested_documents(_scalars, _keys)


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
