"""The cluster sharing config (docs/design.md, Sharing config): its model, its validation, and each
node's labels.

Owns the ``gpuguard-sharing`` document (``version: v1``, ``devicePluginConfig``, ``migConfig``,
``migChangePolicy``, ordered ``rules``), ``parse_sharing`` (every problem at once, as codes with
a path and text; errors make the whole config invalid, warnings do not) and ``match_node`` /
``desired_labels`` (the first rule that matches a node wins; a key the rule omits leaves that
label alone; no rule, no change). Both ``gpuguard check-sharing`` and the agent use exactly
these. Pure: the caller reads the files or ConfigMaps and says which NVIDIA profiles exist, or
that a referenced ConfigMap cannot be read (``MissingConfig``: then only the labels that need it
are held, per rule; the rest of the config applies), and, for ``check-sharing``, which Nodes
there are; configs are hostile input, so every size and count is bounded.

Size: over 600 lines, on purpose: one grammar: the sharing config's parser, its selectors' use and
the checks against NVIDIA's configs read the same document and share its bounds; split, the bounds
would be checked twice or not at all.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuguard.core.problems import Problem, Problems, shown, type_name
from gpuguard.core.selector import (
    LabelSelector,
    dns_subdomain_problem,
    label_value_problem,
    parse_selector,
)

SHARING_VERSION = "v1"
DEVICE_PLUGIN_CONFIG_LABEL = "nvidia.com/device-plugin.config"
"""The label NVIDIA's device plugin (and GFD) read their profile from."""
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
"""The label mig-manager reads its MIG config name from."""
SHARING_LABELS = (DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL)
"""The only labels sharing writes."""
MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
"""mig-manager's progress label: ``pending``, ``rebooting``, ``success`` or ``failed``."""

MIG_MANAGER_LABELS = frozenset(
    {
        MIG_CONFIG_STATE_LABEL,
        "nvidia.com/gpu.deploy.device-plugin",
        "nvidia.com/gpu.deploy.gpu-feature-discovery",
        "nvidia.com/gpu.deploy.dcgm-exporter",
        "nvidia.com/gpu.deploy.dcgm",
        "nvidia.com/gpu.deploy.nvsm",
        "nvidia.com/gpu.deploy.client",
    }
)
"""The Node labels NVIDIA's mig-manager writes while it applies ``nvidia.com/mig.config``: the
state, and each operand's deploy label (``paused-for-mig-change``, then ``true`` again).
NVIDIA/mig-parted ``pkg/mig/reconfigure/reconfigure.go`` (the label constants and
``setNodeLabel``/``setNodeLabels`` calls; v0.15.0, commit bd7160f)."""

OWN_OUTPUT_LABELS = frozenset(SHARING_LABELS) | MIG_MANAGER_LABELS
"""Labels a rule may not select on: the agent writes the first two from these very rules, and
mig-manager the others in answer to the mig label. A rule over them selects on its own output,
so applying it can move the node to another rule (or out of this one) and back, every turn."""

REWRITTEN_LABELS = frozenset(
    {
        "nvidia.com/gpu.product",
        "nvidia.com/gpu.count",
        "nvidia.com/gpu.memory",
        "nvidia.com/gpu.replicas",
        "nvidia.com/gpu.sharing-strategy",
    }
)
"""GFD labels whose values change with the sharing config itself (GPU feature discovery rewrites
them): a rule that selects on them can flip a node to another rule once applied (a feedback
loop)."""

DEFAULT_MIG_CONFIG_KEY = "config.yaml"
"""The data key of mig-parted's config in its ConfigMap (gpu-operator's default)."""

MAX_RULES = 1000
"""Most rules: each node is matched against each rule, on every Node event."""
MAX_NODE_NAMES = 10_000
"""Most ``nodeNames`` in one rule: about the largest Kubernetes cluster supported (5000 nodes)."""
MAX_RULE_NAME_CHARS = 253
MAX_PROBLEMS = 1000
"""Most errors (and, separately, warnings) reported; then one ``too_many_problems``."""

_TOP_KEYS = ("version", "devicePluginConfig", "migConfig", "migChangePolicy", "rules")
_RULE_KEYS = ("name", "nodeSelector", "nodeNames", "timeSlicing", "mig")


class MigChangePolicy(enum.StrEnum):
    """How the agent applies a MIG change (docs/design.md, Sharing config)."""

    WHEN_IDLE = "WhenIdle"
    CORDON = "Cordon"
    DRAIN = "Drain"
    FORCE = "Force"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigMapRef:
    """Where one of NVIDIA's configs lives: the source the agent validates profiles against."""

    namespace: str
    name: str
    key: str | None = None
    """The data key (mig-parted's config); ``None`` for the device plugin (every key a profile)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MissingConfig:
    """A referenced NVIDIA ConfigMap that cannot be read: it does not exist (a cluster with the
    device plugin but without NVIDIA's MIG manager has no mig-parted ConfigMap), or its reader
    may not read it. Not an error of the sharing config, which may serve clusters with and
    without it: the labels that need its profiles are held, per rule; every other label applies.
    """

    code: str
    """``config_map_missing`` (not found) or ``config_map_unreadable`` (e.g. 403)."""
    detail: str
    """What was found: ``"configmap gpu-operator/nvidia-mig-config is not found"``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One rule: which nodes (a selector, or names) and the profiles they get."""

    name: str
    node_selector: LabelSelector | None
    node_names: frozenset[str] | None
    time_slicing: str | None
    """``nvidia.com/device-plugin.config``'s value; ``None`` leaves the label alone."""
    mig: str | None
    """``nvidia.com/mig.config``'s value; ``None`` leaves the label alone."""

    def matches(self, node_labels: Mapping[str, str], node_name: str) -> bool:
        """Whether this rule selects the node."""
        if self.node_names is not None:
            return node_name in self.node_names
        return self.node_selector is not None and self.node_selector.matches(node_labels)

    @property
    def selects_every_node(self) -> bool:
        """A selector with no requirement (Kubernetes: an empty selector selects everything)."""
        return self.node_selector is not None and self.node_selector.selects_everything

    def labels(self) -> dict[str, str]:
        """The labels this rule sets (only those it names)."""
        wanted = {DEVICE_PLUGIN_CONFIG_LABEL: self.time_slicing, MIG_CONFIG_LABEL: self.mig}
        return {label: value for label, value in wanted.items() if value is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class SharingConfig:
    """A valid sharing config."""

    device_plugin_config: ConfigMapRef | None
    mig_config: ConfigMapRef | None
    mig_change_policy: MigChangePolicy
    rules: tuple[Rule, ...]
    unavailable: Mapping[str, MissingConfig] = field(default_factory=dict)
    """Per label (``nvidia.com/device-plugin.config``, ``nvidia.com/mig.config``): the NVIDIA
    ConfigMap its profiles come from cannot be read, so no rule's value for it was checked and
    none is written (``match_node`` holds it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldLabel:
    """A label the matching rule sets but that stays as it is: its value cannot be checked."""

    value: str
    """What the rule sets."""
    reason: str
    """Why it is held: ``"rule 'a100' sets mig 'all-1g.10gb', but configmap … is not found
    (config_map_missing)"``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeMatch:
    """What a config does to one node."""

    rule: str | None
    """The first rule that selects the node; ``None``: no rule does (no change)."""
    labels: Mapping[str, str]
    """The labels to set (only those the rule names and that could be checked)."""
    held: Mapping[str, HeldLabel]
    """The labels the rule names that are left as they are (``SharingConfig.unavailable``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLabels:
    """A Node as rule matching sees it."""

    name: str
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Validation:
    """What ``parse_sharing`` found: the config only when there is no error."""

    config: SharingConfig | None
    errors: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    rules: tuple[Rule | None, ...] = ()
    """Every rule in order as read, ``None`` for one that could not be read: what an invalid
    config's rules select, as far as that can be told (``select_rule``)."""

    @property
    def valid(self) -> bool:
        return not self.errors


def match_node(node_labels: Mapping[str, str], node_name: str, config: SharingConfig) -> NodeMatch:
    """The first rule that selects the node, the labels it sets and those it holds.

    A label the rule does not name is in neither: leave it as it is. A label whose NVIDIA
    ConfigMap cannot be read is held (never written unchecked); the rule's other label is not
    held back by it.
    """
    for rule in config.rules:
        if rule.matches(node_labels, node_name):
            labels: dict[str, str] = {}
            held: dict[str, HeldLabel] = {}
            for label, value in rule.labels().items():
                missing = config.unavailable.get(label)
                if missing is None:
                    labels[label] = value
                    continue
                key = "timeSlicing" if label == DEVICE_PLUGIN_CONFIG_LABEL else "mig"
                held[label] = HeldLabel(
                    value=value,
                    reason=f"rule {shown(rule.name)} sets {key} {shown(value)}, but "
                    f"{missing.detail} ({missing.code})",
                )
            return NodeMatch(rule=rule.name, labels=labels, held=held)
    return NodeMatch(rule=None, labels={}, held={})


def select_rule(
    node_labels: Mapping[str, str], node_name: str, rules: Sequence[Rule | None]
) -> tuple[str | None, bool]:
    """The first of ``rules`` (``Validation.rules``, an invalid config's included) that selects
    the node, and whether that is known: a rule that could not be read before any that selects
    it might have (``(None, False)``). Never what is applied: an invalid config applies nothing.
    """
    for rule in rules:
        if rule is None:
            return None, False
        if rule.matches(node_labels, node_name):
            return rule.name, True
    return None, True


def desired_labels(
    node_labels: Mapping[str, str], node_name: str, config: SharingConfig
) -> tuple[str | None, dict[str, str]]:
    """The first rule that selects the node and the labels it sets; ``(None, {})`` if none does.

    A label the rule does not name, or that ``match_node`` holds, is absent from the result:
    leave it as it is.
    """
    match = match_node(node_labels, node_name, config)
    return match.rule, dict(match.labels)


# ---------------------------------------------------------------------------------------------
# Parsing and validation


def parse_sharing(
    document: object,
    *,
    device_plugin_profiles: frozenset[str] | None = None,
    mig_profiles: frozenset[str] | None = None,
    nodes: Sequence[NodeLabels] | None = None,
    missing: Mapping[str, MissingConfig] | None = None,
) -> Validation:
    """Validate the loaded sharing document and, if it has no error, build its config.

    ``device_plugin_profiles`` are the device plugin ConfigMap's data keys and ``mig_profiles``
    mig-parted's ``mig-configs`` names; ``None`` means not known (not checked). ``missing``,
    by reference (``devicePluginConfig``, ``migConfig``): that ConfigMap cannot be read (its
    profiles must then be ``None``); each rule that needs it gets a warning and its label is
    held (``SharingConfig.unavailable``), the config stays valid. ``nodes``, when given, are the
    Nodes a warning about a rule that selects every node counts.
    """
    found = Problems()
    read: list[Rule | None] = []
    config = _document(
        document, found, (device_plugin_profiles, mig_profiles), missing or {}, nodes, read=read
    )
    errors = _bounded(found.errors, "errors")
    warnings = _bounded(found.warnings, "warnings")
    return Validation(
        config=None if errors else config, errors=errors, warnings=warnings, rules=tuple(read)
    )


def _bounded(problems: list[Problem], what: str) -> tuple[Problem, ...]:
    if len(problems) <= MAX_PROBLEMS:
        return tuple(problems)
    more = Problem(
        code="too_many_problems",
        path="",
        message=f"{len(problems) - MAX_PROBLEMS} more {what} not shown",
    )
    return (*problems[:MAX_PROBLEMS], more)


def _document(
    document: object,
    found: Problems,
    profiles: tuple[frozenset[str] | None, frozenset[str] | None],
    missing: Mapping[str, MissingConfig],
    nodes: Sequence[NodeLabels] | None,
    *,
    read: list[Rule | None],
) -> SharingConfig | None:
    if not isinstance(document, dict):
        found.error(
            "wrong_type", "", f"the sharing config must be a mapping, not {type_name(document)}"
        )
        return None
    for key in document:
        if key not in _TOP_KEYS:
            found.error("unknown_key", _key_path("", key), f"unknown key {shown(key)}")
    version = document.get("version")
    if "version" not in document:
        found.error("missing_key", "version", "version is required (v1)")
    elif version != SHARING_VERSION:
        found.error("unknown_version", "version", f"unknown version {shown(version)} (v1)")
    device_plugin = _ref(document.get("devicePluginConfig"), "devicePluginConfig", False, found)
    mig = _ref(document.get("migConfig"), "migConfig", True, found)
    policy = _policy(document.get("migChangePolicy"), found)
    rules = _rules(document.get("rules"), found)
    raw_rules = document.get("rules")
    if isinstance(raw_rules, list) and len(raw_rules) <= MAX_RULES:
        by_index = dict(rules)
        read.extend(by_index.get(index) for index in range(len(raw_rules)))
    sources = (
        _ProfileSource(
            key="timeSlicing",
            label=DEVICE_PLUGIN_CONFIG_LABEL,
            reference="devicePluginConfig",
            owner="device plugin",
            known=profiles[0],
            referenced="devicePluginConfig" in document,
            missing=missing.get("devicePluginConfig"),
        ),
        _ProfileSource(
            key="mig",
            label=MIG_CONFIG_LABEL,
            reference="migConfig",
            owner="mig-parted",
            known=profiles[1],
            referenced="migConfig" in document,
            missing=missing.get("migConfig"),
        ),
    )
    for source in sources:
        _check_profiles(rules, source, found)
    _warn_every_node(document.get("rules"), rules, policy, nodes, found)
    if policy is None:
        return None
    return SharingConfig(
        device_plugin_config=device_plugin,
        mig_config=mig,
        mig_change_policy=policy,
        rules=tuple(rule for _, rule in rules),
        unavailable={s.label: s.missing for s in sources if s.missing is not None},
    )


def _key_path(parent: str, key: object) -> str:
    name = key if isinstance(key, str) and len(key) <= 63 else shown(key)
    return f"{parent}.{name}" if parent else name


def _ref(raw: object, path: str, has_key: bool, found: Problems) -> ConfigMapRef | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        found.error("wrong_type", path, f"must be a mapping, not {type_name(raw)}")
        return None
    allowed = ("namespace", "name", "key") if has_key else ("namespace", "name")
    for key in raw:
        if key not in allowed:
            found.error("unknown_key", _key_path(path, key), f"unknown key {shown(key)}")
    count = len(found.errors)
    for part in ("namespace", "name"):
        if part not in raw:
            found.error("missing_key", f"{path}.{part}", f"{part} is required")
        else:
            problem = dns_subdomain_problem(raw[part], part)
            if problem is not None:
                found.error("invalid_name", f"{path}.{part}", problem)
    key = raw.get("key", DEFAULT_MIG_CONFIG_KEY) if has_key else None
    if has_key and (not isinstance(key, str) or not key or len(key) > 253):
        found.error(
            "invalid_name", f"{path}.key", f"key must be a ConfigMap data key, not {shown(key)}"
        )
    if len(found.errors) > count or not isinstance(key, str | None):
        return None
    return ConfigMapRef(namespace=raw["namespace"], name=raw["name"], key=key)


def _policy(raw: object, found: Problems) -> MigChangePolicy | None:
    if raw is None:
        return MigChangePolicy.WHEN_IDLE
    for policy in MigChangePolicy:
        if isinstance(raw, str) and raw == policy.value:
            return policy
    choices = ", ".join(p.value for p in MigChangePolicy)
    found.error("invalid_policy", "migChangePolicy", f"{shown(raw)} is not one of {choices}")
    return None


def _rules(raw: object, found: Problems) -> list[tuple[int, Rule]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        found.error("wrong_type", "rules", f"must be a list, not {type_name(raw)}")
        return []
    if len(raw) > MAX_RULES:
        found.error("too_many", "rules", f"{len(raw)} rules, more than {MAX_RULES}")
        return []
    rules: list[tuple[int, Rule]] = []
    first: dict[str, int] = {}
    for index, entry in enumerate(raw):
        path = f"rules[{index}]"
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str) and name:
            if name in first:
                found.error(
                    "duplicate_rule_name",
                    f"{path}.name",
                    f"rule name {shown(name)} is also rules[{first[name]}]'s",
                )
            else:
                first[name] = index
        rule = _rule(entry, path, found)
        if rule is not None:
            rules.append((index, rule))
    return rules


def _rule(raw: object, path: str, found: Problems) -> Rule | None:
    if not isinstance(raw, dict):
        found.error("wrong_type", path, f"a rule must be a mapping, not {type_name(raw)}")
        return None
    count = len(found.errors)
    for key in raw:
        if key not in _RULE_KEYS:
            found.error("unknown_key", _key_path(path, key), f"unknown key {shown(key)}")
    name = raw.get("name")
    if name is None or name == "":
        found.error("missing_rule_name", f"{path}.name", "every rule needs a name")
    elif not isinstance(name, str) or len(name) > MAX_RULE_NAME_CHARS or not name.isprintable():
        found.error(
            "invalid_rule_name",
            f"{path}.name",
            f"a rule name is a printable string of at most {MAX_RULE_NAME_CHARS} characters, "
            f"not {shown(name)}",
        )
    selector, names = _target(raw, path, found)
    time_slicing = _profile(raw.get("timeSlicing"), f"{path}.timeSlicing", found)
    mig = _profile(raw.get("mig"), f"{path}.mig", found)
    if raw.get("timeSlicing") is None and raw.get("mig") is None:
        found.error("empty_rule", path, "a rule sets timeSlicing, mig or both")
    if len(found.errors) > count or not isinstance(name, str):
        return None
    return Rule(
        name=name,
        node_selector=selector,
        node_names=names,
        time_slicing=time_slicing,
        mig=mig,
    )


def _target(
    raw: Mapping[str, object], path: str, found: Problems
) -> tuple[LabelSelector | None, frozenset[str] | None]:
    has_selector = raw.get("nodeSelector") is not None
    has_names = raw.get("nodeNames") is not None
    if has_selector and has_names:
        found.error("selector_and_node_names", path, "set nodeSelector or nodeNames, not both")
    elif not has_selector and not has_names:
        found.error("no_selector_or_node_names", path, "set nodeSelector or nodeNames")
    selector = None
    if has_selector:
        selector, problems = parse_selector(raw["nodeSelector"], path=f"{path}.nodeSelector")
        found.errors.extend(problems)
        if selector is not None:
            _reject_own_output(raw, selector, f"{path}.nodeSelector", found)
            _warn_rewritten(selector, f"{path}.nodeSelector", found)
    names = _node_names(raw["nodeNames"], f"{path}.nodeNames", found) if has_names else None
    return selector, names


def _reject_own_output(
    raw: Mapping[str, object], selector: LabelSelector, path: str, found: Problems
) -> None:
    """An error for each ``matchLabels`` key and ``matchExpressions`` entry (any operator) over a
    label the agent or mig-manager writes (``OWN_OUTPUT_LABELS``). Such a rule selects on its
    own output: the value it applies decides whether it (or another rule) matches next turn, so
    the label can flip for ever, a Node write and an Event each turn and, for the mig label, a
    re-partition of the GPUs each time."""
    if not selector.keys & OWN_OUTPUT_LABELS:
        return
    rule = shown(raw.get("name"))
    spelled = raw["nodeSelector"]
    assert isinstance(spelled, dict)  # it parsed into a selector
    places: list[tuple[str, str]] = []
    for key in spelled.get("matchLabels") or {}:
        if key in OWN_OUTPUT_LABELS:
            places.append((key, _key_path(f"{path}.matchLabels", key)))
    for index, entry in enumerate(spelled.get("matchExpressions") or []):
        key = entry.get("key") if isinstance(entry, dict) else None
        if key in OWN_OUTPUT_LABELS:
            assert isinstance(key, str)
            places.append((key, f"{path}.matchExpressions[{index}]"))
    for key, where in places:
        writer = (
            "gpuguard's agent writes from these rules"
            if key in SHARING_LABELS
            else f"NVIDIA's mig-manager writes while it applies {MIG_CONFIG_LABEL}"
        )
        found.error(
            "selects_own_output",
            where,
            f"rule {rule} selects on {key}, which {writer}: the rule would select on its own "
            "output, so once a value is applied the node can match another rule (or stop "
            "matching) and the label flips every turn, a Node write and an Event each time and "
            "a MIG re-partition for each change of the mig label. Select on labels sharing "
            "does not write (node.kubernetes.io/instance-type, nvidia.com/gpu.family, a label "
            "of your own) or name the nodes (nodeNames)",
        )


def _warn_rewritten(selector: LabelSelector, path: str, found: Problems) -> None:
    for key in sorted(selector.keys & REWRITTEN_LABELS):
        found.warn(
            "selects_rewritten_label",
            path,
            f"selects on {key}, which NVIDIA's feature discovery rewrites when sharing changes: "
            "the node may stop matching once its labels are applied (select on "
            "node.kubernetes.io/instance-type or nvidia.com/gpu.family instead)",
        )


def _warn_every_node(
    raw_rules: object,
    rules: list[tuple[int, Rule]],
    policy: MigChangePolicy | None,
    nodes: Sequence[NodeLabels] | None,
    found: Problems,
) -> None:
    """Warn about each rule whose selector has no requirement. Kubernetes is right that it
    selects every node, and a last catch-all rule is legitimate, so this is no error; but the
    same selector by mistake changes every GPU node of the cluster at once (each node's agent
    acts alone: nothing takes turns), and hides every rule after it."""
    everything = [position for position, (_, rule) in enumerate(rules) if rule.selects_every_node]
    if not everything:
        return
    # Which rule wins each node is told only for a valid config: an invalid one applies nothing.
    winners = _winners(rules, nodes) if nodes and not found.errors else None
    for position in everything:
        index, rule = rules[position]
        spelling = _selector_spelling(raw_rules, index)
        later = [later_rule.name for _, later_rule in rules[position + 1 :]]
        hidden = f"; the rules after it never match ({_few_names(later)})" if later else ""
        found.warn(
            "selects_every_node",
            f"rules[{index}].nodeSelector",
            f"rule {shown(rule.name)}: nodeSelector {spelling} has no requirement, so it "
            f"matches every node{_node_count(position, nodes, winners)}; "
            f"{_effect(rule, policy)}{hidden}. Name the nodes (nodeNames) or labels to narrow "
            "it, unless it is meant as the last, catch-all rule",
        )


def _winners(rules: list[tuple[int, Rule]], nodes: Sequence[NodeLabels]) -> list[int]:
    """How many of ``nodes`` each rule (by position) is the first to match."""
    counts = [0] * len(rules)
    for node in nodes:
        for position, (_, rule) in enumerate(rules):
            if rule.matches(node.labels, node.name):
                counts[position] += 1
                break
    return counts


def _selector_spelling(raw_rules: object, index: int) -> str:
    """Rule ``index``'s (valid, empty) selector as written: ``{}``, ``{matchLabels: null}``..."""
    entry = raw_rules[index] if isinstance(raw_rules, list) else None
    raw = entry.get("nodeSelector") if isinstance(entry, dict) else None
    if not isinstance(raw, dict) or not raw:
        return "{}"
    empty = {type(None): "null", dict: "{}", list: "[]"}
    parts = [f"{key}: {empty.get(type(value), shown(value))}" for key, value in raw.items()]
    return "{" + ", ".join(parts) + "}"


def _node_count(
    position: int, nodes: Sequence[NodeLabels] | None, winners: list[int] | None
) -> str:
    """`` (2 of the 3 nodes given; earlier rules take the other 1)``; ``""`` without nodes."""
    if not nodes:
        return ""
    total = len(nodes)
    if winners is None:
        return f" (all {total} nodes given)"
    taken = total - winners[position]
    reached = f" ({winners[position]} of the {total} nodes given"
    return f"{reached}; earlier rules take the other {taken})" if taken else f"{reached})"


def _effect(rule: Rule, policy: MigChangePolicy | None) -> str:
    """What the rule does to every node at once, under the policy in force."""
    effects = []
    if rule.time_slicing is not None:
        effects.append(
            f"every matching node's device plugin switches to timeSlicing "
            f"{shown(rule.time_slicing)} at once (migChangePolicy does not hold that back)"
        )
    if rule.mig is not None:
        mig = shown(rule.mig)
        effects.append(
            {
                MigChangePolicy.FORCE: f"with migChangePolicy Force every matching node's MIG "
                f"layout is changed to {mig} at once, under its running GPU pods",
                MigChangePolicy.DRAIN: "with migChangePolicy Drain every matching node is "
                f"cordoned and its GPU pods evicted at the same time, to change its MIG layout "
                f"to {mig}",
                MigChangePolicy.CORDON: "with migChangePolicy Cordon every matching node is "
                "cordoned at the same time until its GPU pods finish, then its MIG layout is "
                f"changed to {mig}",
                MigChangePolicy.WHEN_IDLE: "with migChangePolicy WhenIdle every matching node's "
                f"MIG layout is changed to {mig} as soon as it has no GPU pod",
                None: f"every matching node's MIG layout is changed to {mig}",
            }[policy]
        )
    return "; ".join(effects)


def _few_names(names: list[str]) -> str:
    more = f", … {len(names) - 8} more" if len(names) > 8 else ""
    return ", ".join(shown(n) for n in names[:8]) + more


def _node_names(raw: object, path: str, found: Problems) -> frozenset[str] | None:
    if not isinstance(raw, list):
        found.error("wrong_type", path, f"must be a list of node names, not {type_name(raw)}")
        return None
    if len(raw) > MAX_NODE_NAMES:
        found.error("too_many", path, f"{len(raw)} node names, more than {MAX_NODE_NAMES}")
        return None
    if not raw:
        found.error(
            "no_selector_or_node_names", path, "nodeNames is empty: the rule selects nothing"
        )
        return None
    bad = False
    for index, name in enumerate(raw):
        problem = dns_subdomain_problem(name, "a node name")
        if problem is not None:
            bad = True
            found.error("invalid_node_name", f"{path}[{index}]", problem)
    return None if bad else frozenset(raw)


def _profile(raw: object, path: str, found: Problems) -> str | None:
    if raw is None:
        return None
    problem = label_value_problem(raw)
    if problem is None and raw == "":
        problem = "a profile name must not be empty"
    if problem is not None:
        found.error("invalid_label_value", path, problem)
        return None
    assert isinstance(raw, str)
    return raw


@dataclass(frozen=True, slots=True, kw_only=True)
class _ProfileSource:
    key: str
    """The rule key: ``timeSlicing`` or ``mig``."""
    label: str
    """The Node label the rule key sets."""
    reference: str
    """The top-level key naming the source: ``devicePluginConfig`` or ``migConfig``."""
    owner: str
    known: frozenset[str] | None
    referenced: bool
    missing: MissingConfig | None = None


def _check_profiles(rules: list[tuple[int, Rule]], source: _ProfileSource, found: Problems) -> None:
    used = [(i, r) for i, r in rules if _profile_of(r, source.key) is not None]
    if source.missing is not None:
        _warn_missing(used, source, source.missing, found)
        return
    if not used:
        return
    if source.known is None:
        found.warn(
            "profiles_not_checked",
            source.key,
            f"{len(used)} rule(s) set {source.key} but the {source.owner} config was not read: "
            "their profile names are not checked",
        )
    else:
        for index, rule in used:
            value = _profile_of(rule, source.key)
            if value not in source.known:
                found.error(
                    "unknown_profile",
                    f"rules[{index}].{source.key}",
                    f"{shown(value)} is not a profile of the {source.owner} config "
                    f"(known: {_few(source.known)})",
                )
    if not source.referenced:
        found.warn(
            "no_profile_source",
            source.reference,
            f"rules set {source.key} but {source.reference} is not set: the agent cannot check "
            "that their profiles exist",
        )


def _warn_missing(
    used: list[tuple[int, Rule]], source: _ProfileSource, missing: MissingConfig, found: Problems
) -> None:
    """A referenced ConfigMap that cannot be read: one warning per rule that needs it (the nodes
    it matches keep that label), or one saying that no rule does (then it changes nothing)."""
    if not used:
        found.warn(
            missing.code,
            source.reference,
            f"{missing.detail}; no rule sets {source.key}, so no rule needs it",
        )
        return
    for index, rule in used:
        found.warn(
            missing.code,
            f"rules[{index}].{source.key}",
            f"rule {shown(rule.name)} sets {source.key} {shown(_profile_of(rule, source.key))}, "
            f"but {missing.detail}: the nodes it matches keep their {source.label} as it is "
            f"until the {source.owner} ConfigMap can be read; their other label still applies",
        )


def _profile_of(rule: Rule, key: str) -> str | None:
    return rule.time_slicing if key == "timeSlicing" else rule.mig


def _few(names: frozenset[str]) -> str:
    shown_names = sorted(names)[:8]
    more = f", … {len(names) - 8} more" if len(names) > 8 else ""
    return ", ".join(shown(n) for n in shown_names) + more if names else "none"
