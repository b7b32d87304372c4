"""Kubernetes label selectors: parsing, validation and matching, exactly as Kubernetes does them.

Owns ``LabelSelector`` (``matchLabels`` AND ``matchExpressions``; operators ``In``, ``NotIn``,
``Exists``, ``DoesNotExist``) as apimachinery's ``LabelSelectorAsSelector`` means it: an empty
selector matches every node; ``NotIn`` matches a node without the key; ``In``/``NotIn`` need
values and ``Exists``/``DoesNotExist`` take none. Label keys and values are validated as
apimachinery's ``IsQualifiedName`` and ``IsValidLabelValue`` do. Also owns the label syntax
checks other validators reuse. Pure: no I/O; parsing reports ``Problem``s, never raises.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuguard.core.problems import Problem, shown, type_name

MAX_MATCH_LABELS = 256
"""Most ``matchLabels`` entries in one selector: far more than any real selector."""
MAX_EXPRESSIONS = 256
"""Most ``matchExpressions`` in one selector."""
MAX_VALUES = 1024
"""Most values of one ``In``/``NotIn`` expression."""

_NAME_MAX = 63
_PREFIX_MAX = 253
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", re.ASCII)
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*", re.ASCII)


class Operator(enum.StrEnum):
    """A ``matchExpressions`` operator."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


@dataclass(frozen=True, slots=True, kw_only=True)
class Requirement:
    """One ``matchExpressions`` entry (or one ``matchLabels`` pair, as ``In`` of one value)."""

    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` satisfies this requirement."""
        if self.operator is Operator.EXISTS:
            return self.key in labels
        if self.operator is Operator.DOES_NOT_EXIST:
            return self.key not in labels
        if self.operator is Operator.IN:
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelSelector:
    """A parsed, valid label selector: every requirement must hold (AND)."""

    requirements: tuple[Requirement, ...] = field(default=())

    @property
    def keys(self) -> frozenset[str]:
        """Every label key the selector looks at."""
        return frozenset(r.key for r in self.requirements)

    @property
    def selects_everything(self) -> bool:
        """No requirement: every node is selected (``{}``, ``{matchLabels: {}}``,
        ``{matchExpressions: []}``, either one null, ...). The only selector that does: each
        requirement fails on some labels (``In``/``Exists`` on none, ``NotIn`` on one of its
        values, ``DoesNotExist`` on the key), so a non-empty one never selects every node."""
        return not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` is selected; an empty selector selects every node."""
        return all(r.matches(labels) for r in self.requirements)


# ---------------------------------------------------------------------------------------------
# Label syntax (apimachinery pkg/util/validation)


def label_key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid label key (a qualified name), or ``None`` if it is."""
    if not isinstance(key, str):
        return f"a label key must be a string, not {type_name(key)}"
    parts = key.split("/")
    if len(parts) > 2:
        return f"label key {shown(key)} has more than one '/'"
    prefix_problem = _prefix_problem(key, parts[0]) if len(parts) == 2 else None
    if prefix_problem is not None:
        return prefix_problem
    name = parts[-1]
    if not name:
        return f"label key {shown(key)} has an empty name"
    if len(name) > _NAME_MAX or _NAME.fullmatch(name) is None:
        return (
            f"label key {shown(key)}: the name must be at most {_NAME_MAX} characters of "
            "[A-Za-z0-9-_.], starting and ending with a letter or digit"
        )
    return None


def _prefix_problem(key: str, prefix: str) -> str | None:
    if not prefix:
        return f"label key {shown(key)} has an empty prefix before '/'"
    if len(prefix) > _PREFIX_MAX or _DNS_SUBDOMAIN.fullmatch(prefix) is None:
        return (
            f"label key {shown(key)}: the prefix must be a lowercase DNS subdomain of at "
            f"most {_PREFIX_MAX} characters"
        )
    return None


def label_value_problem(value: object) -> str | None:
    """Why ``value`` is not a valid label value, or ``None`` if it is (empty is valid)."""
    if not isinstance(value, str):
        return f"a label value must be a string, not {type_name(value)}"
    if value and (len(value) > _NAME_MAX or _NAME.fullmatch(value) is None):
        return (
            f"label value {shown(value)} must be empty or at most {_NAME_MAX} characters of "
            "[A-Za-z0-9-_.], starting and ending with a letter or digit"
        )
    return None


def dns_subdomain_problem(name: object, what: str) -> str | None:
    """Why ``name`` is not a DNS-1123 subdomain (a Node's or ConfigMap's name), or ``None``."""
    if not isinstance(name, str):
        return f"{what} must be a string, not {type_name(name)}"
    if not name or len(name) > _PREFIX_MAX or _DNS_SUBDOMAIN.fullmatch(name) is None:
        return (
            f"{what} {shown(name)} is not a lowercase DNS subdomain of 1 to {_PREFIX_MAX} "
            "characters"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_selector(raw: object, *, path: str) -> tuple[LabelSelector | None, list[Problem]]:
    """The selector in ``raw`` (a loaded ``LabelSelector`` mapping) and every problem in it.

    Returns ``(None, problems)`` when anything is wrong: a selector with an invalid part is not
    applied partly. ``path`` prefixes every problem's path.
    """
    if not isinstance(raw, dict):
        return None, [Problem(code="wrong_type", path=path, message=_must_be(raw, "a mapping"))]
    problems: list[Problem] = []
    for key in raw:
        if key not in ("matchLabels", "matchExpressions"):
            problems.append(
                Problem(
                    code="unknown_key",
                    path=f"{path}.{key}" if isinstance(key, str) else path,
                    message=f"unknown key {shown(key)} (a selector has matchLabels and "
                    "matchExpressions)",
                )
            )
    requirements = _match_labels(raw.get("matchLabels"), f"{path}.matchLabels", problems)
    requirements += _match_expressions(
        raw.get("matchExpressions"), f"{path}.matchExpressions", problems
    )
    if problems:
        return None, problems
    return LabelSelector(requirements=tuple(requirements)), []


def _must_be(value: object, expected: str) -> str:
    return f"must be {expected}, not {type_name(value)}"


def _match_labels(raw: object, path: str, problems: list[Problem]) -> list[Requirement]:
    if raw is None:
        return []
    if not isinstance(raw, dict):
        problems.append(Problem(code="wrong_type", path=path, message=_must_be(raw, "a mapping")))
        return []
    if len(raw) > MAX_MATCH_LABELS:
        problems.append(
            Problem(code="too_many", path=path, message=f"more than {MAX_MATCH_LABELS} labels")
        )
        return []
    requirements = []
    for key, value in raw.items():
        where = f"{path}[{shown(key)}]"
        key_problem = label_key_problem(key)
        if key_problem is not None:
            problems.append(Problem(code="invalid_label_key", path=where, message=key_problem))
        value_problem = label_value_problem(value)
        if value_problem is not None:
            problems.append(Problem(code="invalid_label_value", path=where, message=value_problem))
        if key_problem is None and value_problem is None:
            requirements.append(
                Requirement(key=key, operator=Operator.IN, values=frozenset([value]))
            )
    return requirements


def _match_expressions(raw: object, path: str, problems: list[Problem]) -> list[Requirement]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(Problem(code="wrong_type", path=path, message=_must_be(raw, "a list")))
        return []
    if len(raw) > MAX_EXPRESSIONS:
        problems.append(
            Problem(code="too_many", path=path, message=f"more than {MAX_EXPRESSIONS} expressions")
        )
        return []
    requirements = []
    for index, expression in enumerate(raw):
        requirement = _expression(expression, f"{path}[{index}]", problems)
        if requirement is not None:
            requirements.append(requirement)
    return requirements


def _expression(raw: object, path: str, problems: list[Problem]) -> Requirement | None:
    if not isinstance(raw, dict):
        problems.append(Problem(code="wrong_type", path=path, message=_must_be(raw, "a mapping")))
        return None
    count = len(problems)
    for key in raw:
        if key not in ("key", "operator", "values"):
            problems.append(
                Problem(
                    code="unknown_key",
                    path=path,
                    message=f"unknown key {shown(key)} (an expression has key, operator, values)",
                )
            )
    key = raw.get("key")
    key_problem = "key is missing" if key is None else label_key_problem(key)
    if key_problem is not None:
        problems.append(Problem(code="invalid_label_key", path=f"{path}.key", message=key_problem))
    operator = _operator(raw.get("operator"), f"{path}.operator", problems)
    values = _values(raw.get("values"), operator, f"{path}.values", problems)
    if len(problems) > count or operator is None or values is None or not isinstance(key, str):
        return None
    return Requirement(key=key, operator=operator, values=values)


def _operator(raw: object, path: str, problems: list[Problem]) -> Operator | None:
    for operator in Operator:
        if raw == operator.value and isinstance(raw, str):
            return operator
    problems.append(
        Problem(
            code="invalid_selector_operator",
            path=path,
            message=f"{shown(raw)} is not a valid selector operator (In, NotIn, Exists, "
            "DoesNotExist)",
        )
    )
    return None


def _values(
    raw: object, operator: Operator | None, path: str, problems: list[Problem]
) -> frozenset[str] | None:
    if raw is not None and not isinstance(raw, list):
        problems.append(Problem(code="wrong_type", path=path, message=_must_be(raw, "a list")))
        return None
    values = raw or []
    if len(values) > MAX_VALUES:
        problems.append(Problem(code="too_many", path=path, message=f"more than {MAX_VALUES}"))
        return None
    if operator in (Operator.IN, Operator.NOT_IN) and not values:
        problems.append(
            Problem(
                code="invalid_selector_values",
                path=path,
                message=f"operator {operator} needs at least one value",
            )
        )
    if operator in (Operator.EXISTS, Operator.DOES_NOT_EXIST) and values:
        problems.append(
            Problem(
                code="invalid_selector_values",
                path=path,
                message=f"operator {operator} takes no values",
            )
        )
    bad = False
    for index, value in enumerate(values):
        value_problem = label_value_problem(value)
        if value_problem is not None:
            bad = True
            problems.append(
                Problem(code="invalid_label_value", path=f"{path}[{index}]", message=value_problem)
            )
    return None if bad else frozenset(values)
