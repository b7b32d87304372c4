"""core.selector: Kubernetes LabelSelector semantics and label syntax, as tables and properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.selector import (
    LabelSelector,
    label_key_problem,
    label_value_problem,
    parse_selector,
)


def selector(raw: Any) -> LabelSelector:
    parsed, problems = parse_selector(raw, path="s")
    assert problems == [], problems
    assert parsed is not None
    return parsed


NODE = {"node.kubernetes.io/instance-type": "g4dn.12xlarge", "zone": "a", "gpu": "t4"}

MATCHES = [
    ({}, True),
    ({"matchLabels": {}, "matchExpressions": []}, True),
    ({"matchLabels": None}, True),
    ({"matchLabels": {"zone": "a"}}, True),
    ({"matchLabels": {"zone": "b"}}, False),
    ({"matchLabels": {"zone": "a", "gpu": "t4"}}, True),
    ({"matchLabels": {"zone": "a", "gpu": "a100"}}, False),
    ({"matchLabels": {"missing": ""}}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}, False),
    ({"matchExpressions": [{"key": "nokey", "operator": "In", "values": ["b"]}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["b"]}]}, True),
    ({"matchExpressions": [{"key": "nokey", "operator": "NotIn", "values": ["b"]}]}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, True),
    ({"matchExpressions": [{"key": "nokey", "operator": "Exists"}]}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, False),
    ({"matchExpressions": [{"key": "nokey", "operator": "DoesNotExist", "values": []}]}, True),
    (
        {
            "matchLabels": {"zone": "a"},
            "matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}],
        },
        False,
    ),
    (
        {
            "matchLabels": {"node.kubernetes.io/instance-type": "g4dn.12xlarge"},
            "matchExpressions": [{"key": "gpu", "operator": "Exists"}],
        },
        True,
    ),
]


@pytest.mark.parametrize(("raw", "expected"), MATCHES)
def test_matches_as_kubernetes_does(raw: Any, expected: bool) -> None:
    assert selector(raw).matches(NODE) is expected


INVALID = [
    ("not a mapping", "wrong_type"),
    ({"matchLabel": {"a": "b"}}, "unknown_key"),
    ({"matchLabels": ["a"]}, "wrong_type"),
    ({"matchLabels": {"a b": "c"}}, "invalid_label_key"),
    ({"matchLabels": {"a": "c d"}}, "invalid_label_value"),
    ({"matchLabels": {"a": 3}}, "invalid_label_value"),
    ({"matchExpressions": {"key": "a"}}, "wrong_type"),
    ({"matchExpressions": ["a"]}, "wrong_type"),
    (
        {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
        "invalid_selector_operator",
    ),
    (
        {"matchExpressions": [{"key": "a", "operator": "in", "values": ["1"]}]},
        "invalid_selector_operator",
    ),
    ({"matchExpressions": [{"key": "a"}]}, "invalid_selector_operator"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "invalid_selector_values"),
    (
        {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": []}]},
        "invalid_selector_values",
    ),
    (
        {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
        "invalid_selector_values",
    ),
    (
        {"matchExpressions": [{"key": "a", "operator": "DoesNotExist", "values": ["x"]}]},
        "invalid_selector_values",
    ),
    ({"matchExpressions": [{"operator": "Exists"}]}, "invalid_label_key"),
    (
        {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b c"]}]},
        "invalid_label_value",
    ),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": "b"}]}, "wrong_type"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "value": "b"}]}, "unknown_key"),
    ({"matchLabels": {str(i): "x" for i in range(300)}}, "too_many"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}] * 300}, "too_many"),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["x"] * 2000}]}, "too_many"),
]


@pytest.mark.parametrize(("raw", "code"), INVALID)
def test_rejects_what_kubernetes_rejects_with_a_code(raw: Any, code: str) -> None:
    parsed, problems = parse_selector(raw, path="rules[0].nodeSelector")
    assert parsed is None
    assert problems
    codes = {p.code for p in problems}
    assert code in codes, problems
    assert all(p.path.startswith("rules[0].nodeSelector") for p in problems)


def test_reports_every_problem_of_a_selector_at_once() -> None:
    _, problems = parse_selector(
        {
            "matchLabels": {"bad key!": "ok", "ok": "bad value!"},
            "matchExpressions": [
                {"key": "a", "operator": "Near"},
                {"key": "b", "operator": "In"},
            ],
            "extra": 1,
        },
        path="s",
    )
    assert sorted(p.code for p in problems) == [
        "invalid_label_key",
        "invalid_label_value",
        "invalid_selector_operator",
        "invalid_selector_values",
        "unknown_key",
    ]


KEYS = [
    ("a", True),
    ("A-b_c.d9", True),
    ("nvidia.com/gpu.product", True),
    ("node.kubernetes.io/instance-type", True),
    ("x" * 63, True),
    ("x" * 64, False),
    ("a" * 253 + "/b", True),
    ("a" * 254 + "/b", False),
    ("", False),
    ("/a", False),
    ("a/", False),
    ("a/b/c", False),
    ("Upper.com/a", False),
    ("-a", False),
    ("a-", False),
    ("a b", False),
    ("é", False),
    ("a\n", False),
    ("bad_prefix/a", False),
]


@pytest.mark.parametrize(("key", "valid"), KEYS)
def test_label_keys_are_qualified_names(key: str, valid: bool) -> None:
    assert (label_key_problem(key) is None) is valid


VALUES = [
    ("", True),
    ("slice-4", True),
    ("2x2g.10gb-3x1g.5gb", True),
    ("all-1g.5gb.me", True),
    ("A_b.C", True),
    ("x" * 63, True),
    ("x" * 64, False),
    ("-a", False),
    ("a.", False),
    ("a/b", False),
    ("a+b", False),
    ("١", False),
    ("a\n", False),
    (4, False),
    (None, False),
]


@pytest.mark.parametrize(("value", "valid"), VALUES)
def test_label_values_follow_kubernetes_syntax(value: object, valid: bool) -> None:
    assert (label_value_problem(value) is None) is valid


_label_text = st.from_regex(r"[a-z]([a-z0-9]{0,6}[a-z])?", fullmatch=True)
_labels = st.dictionaries(_label_text, _label_text, max_size=6)


@given(labels=_labels)
def test_an_empty_selector_matches_every_node(labels: dict[str, str]) -> None:
    assert selector({}).matches(labels)


@given(labels=_labels, key=_label_text, values=st.lists(_label_text, min_size=1, max_size=4))
def test_not_in_is_the_negation_of_in(labels: dict[str, str], key: str, values: list[str]) -> None:
    in_ = selector({"matchExpressions": [{"key": key, "operator": "In", "values": values}]})
    not_in = selector({"matchExpressions": [{"key": key, "operator": "NotIn", "values": values}]})
    assert in_.matches(labels) is not not_in.matches(labels)


@given(labels=_labels, key=_label_text)
def test_exists_is_the_negation_of_does_not_exist(labels: dict[str, str], key: str) -> None:
    exists = selector({"matchExpressions": [{"key": key, "operator": "Exists"}]})
    absent = selector({"matchExpressions": [{"key": key, "operator": "DoesNotExist"}]})
    assert exists.matches(labels) is (key in labels)
    assert absent.matches(labels) is (key not in labels)


@given(labels=_labels, wanted=_labels)
def test_match_labels_is_subset_of_the_node_labels(
    labels: dict[str, str], wanted: dict[str, str]
) -> None:
    expected = all(labels.get(k) == v for k, v in wanted.items())
    assert selector({"matchLabels": wanted}).matches(labels) is expected


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"matchLabels": None},
        {"matchLabels": {}},
        {"matchExpressions": None},
        {"matchExpressions": []},
        {"matchLabels": None, "matchExpressions": None},
        {"matchLabels": {}, "matchExpressions": []},
    ],
)
def test_every_spelling_of_no_requirement_selects_everything(raw: Any) -> None:
    assert selector(raw).selects_everything


_expression = st.one_of(
    st.builds(
        lambda key, op, values: {"key": key, "operator": op, "values": values},
        _label_text,
        st.sampled_from(["In", "NotIn"]),
        st.lists(_label_text, min_size=1, max_size=3),
    ),
    st.builds(
        lambda key, op: {"key": key, "operator": op},
        _label_text,
        st.sampled_from(["Exists", "DoesNotExist"]),
    ),
)


@given(
    match_labels=_labels,
    expressions=st.lists(_expression, max_size=3),
)
def test_a_selector_with_a_requirement_does_not_select_every_node(
    match_labels: dict[str, str], expressions: list[dict[str, Any]]
) -> None:
    parsed = selector({"matchLabels": match_labels, "matchExpressions": expressions})
    if not parsed.requirements:
        assert parsed.selects_everything
        return
    assert not parsed.selects_everything
    # A node it does not select: the first requirement fails on it, whatever the others say.
    first = parsed.requirements[0]
    witness = {
        "In": {},
        "Exists": {},
        "NotIn": {first.key: min(first.values, default="")},
        "DoesNotExist": {first.key: ""},
    }[first.operator.value]
    assert not parsed.matches(witness)
