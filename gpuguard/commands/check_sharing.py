"""``gpuguard check-sharing``: validate a sharing config (docs/design.md, Sharing config) before it
is applied.

Owns the ``check-sharing`` contract (docs/design.md, CLI outputs): one JSON document
``{"valid", "errors", "warnings", "nodes"}``; ``nodes`` has one entry per Node in the ``--node``
files (then, with ``--cluster-nodes``, the cluster's), in order, with ``name``, ``rule`` (the first
rule that matches, or null) and ``labels``, an object that always holds both
``nvidia.com/device-plugin.config`` and ``nvidia.com/mig.config``: the value the rule sets, or
**null when that label is left alone** (the rule omits the key, no rule matches, the sharing
config is invalid: an invalid config changes nothing, or the label is held). Additive keys:
``references`` (how each NVIDIA ConfigMap the config names was checked: ``file``, ``cluster``,
``missing``, ``unreadable``, ``not_checked``, or null when the config names none) and per node
``held`` (label → why the rule's value is not applied: its ConfigMap is missing in the cluster).
With an invalid config nothing is applied (every label null), but ``rule`` still names the rule
that selects the node, or is null with ``rule_unknown`` where a rule that could not be read comes
first (it may have selected the node).
Errors and warnings are strings, ``"<where>: <what> (<code>)"``, the code a stable snake_case
name (``core.problems``).

Reads every file through ``adapters.manifest`` (bounded, safe YAML). Each FILE is a ConfigMap
manifest or the raw config: the sharing config's key is ``sharing.yaml``; the device plugin's
ConfigMap has one profile per data key (a raw file is one profile named after the file, without
``.yaml``/``.yml``); mig-parted's key is ``migConfig.key`` (default ``config.yaml``). A
ConfigMap other than the one the sharing config names is a warning (``other_config_map``). A
Node file holds Nodes or a List of them; the Nodes also go to validation, so that the warning
about a rule that selects every node (``selects_every_node``) says how many it gets.

The report and the message on stderr escape what they show (``core.text.printable``): file,
rule, profile and ConfigMap names come from files and a cluster others write. The JSON is exact.

Talks to a cluster only with ``--kubeconfig`` (never ``KUBECONFIG`` or in-cluster config: the
result depends only on the arguments): then the ConfigMaps the sharing config names that no file
stands for are read from the cluster through ``adapters.kube.reads`` (the agent's list; built by
``gpuguard.app``) and interpreted exactly as the agent interprets them. A missing one holds, as in
the agent, only the labels of the rules that need it (a warning per rule; still valid); one this
kubeconfig may not read is not checked (a warning). Without files or ``--kubeconfig`` the profile
names are not checked at all, which a warning says plainly (``references_not_checked``). Exit 0
valid; 1 invalid (an error in any config, or a file that is not UTF-8, binary, too large, hostile
or of the wrong shape: one line on stderr); 2 a file that cannot be opened, or a cluster that
cannot be read.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    InputError,
    load_yaml_documents,
    read_bounded,
    shorten,
)
from gpuguard.adapters.sharing_documents import (
    SHARING_KEY,
    DocumentError,
    Findings,
    config_map_profiles,
    config_map_ref,
    config_map_where,
    data_value,
    device_plugin_profiles,
    mig_key,
    mig_profiles,
    missing_config_map,
    single_document,
    validate_sharing,
)
from gpuguard.commands.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from gpuguard.core.nvidia_configs import check_device_plugin_config
from gpuguard.core.selector import dns_subdomain_problem, label_key_problem
from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    SHARING_LABELS,
    ConfigMapRef,
    MissingConfig,
    NodeLabels,
    Validation,
    match_node,
    select_rule,
)
from gpuguard.core.text import display_width, pad, printable
from gpuguard.errors import ConfigError, GpuguardError, KubeForbidden

MAX_NODES = 10_000
"""Most Nodes read from the ``--node`` files together."""
MAX_NODE_LABELS = 1024
"""Most labels on one Node read."""

_PROG = "gpuguard check-sharing"
_REFERENCES = ("devicePluginConfig", "migConfig")


class _FileFailure(GpuguardError):
    """A file that cannot be checked at all. ``exit_code``: 2 cannot be opened, 1 invalid."""

    def __init__(self, message: str, *, exit_code: int = EXIT_INVALID) -> None:
        self.exit_code = exit_code
        super().__init__(message)


def run_check_sharing(
    *,
    sharing_path: str,
    device_plugin_path: str | None,
    mig_path: str | None,
    node_paths: Sequence[str],
    as_json: bool,
    stdout: TextIO,
    stderr: TextIO | None = None,
    kubeconfig: str | None = None,
    cluster_nodes: bool = False,
) -> int:
    """The CLI entry: check the files, print JSON or a report, return the exit code."""
    err = sys.stderr if stderr is None else stderr
    try:
        result = check_sharing(
            sharing_path=sharing_path,
            device_plugin_path=device_plugin_path,
            mig_path=mig_path,
            node_paths=node_paths,
            kubeconfig=kubeconfig,
            cluster_nodes=cluster_nodes,
        )
    except _FileFailure as failure:
        print(printable(f"{_PROG}: {failure}"), file=err)
        if as_json and failure.exit_code == EXIT_INVALID:
            failed = {"valid": False, "errors": [str(failure)], "warnings": [], "nodes": []}
            json.dump(failed, stdout, indent=2)
            stdout.write("\n")
        return failure.exit_code
    if as_json:
        json.dump(result, stdout, indent=2)
        stdout.write("\n")
    else:
        _print_report(result, sharing_path, stdout)
    return EXIT_OK if result["valid"] else EXIT_INVALID


def check_sharing(
    *,
    sharing_path: str,
    device_plugin_path: str | None,
    mig_path: str | None,
    node_paths: Sequence[str],
    kubeconfig: str | None = None,
    cluster_nodes: bool = False,
) -> dict[str, Any]:
    """The object (docs/design.md, CLI outputs) for these files (and, with ``kubeconfig``, the
    cluster's ConfigMaps and, with ``cluster_nodes``, its Nodes). Raises ``_FileFailure`` for an
    unusable file or a cluster that cannot be read."""
    if cluster_nodes and kubeconfig is None:
        raise _FileFailure("--cluster-nodes needs --kubeconfig", exit_code=EXIT_USAGE)
    findings = Findings()
    document, _ = _config_document(sharing_path, SHARING_KEY, "sharing config")
    profiles: dict[str, frozenset[str] | None] = dict.fromkeys(_REFERENCES)
    references: dict[str, str | None] = {
        reference: None if config_map_ref(document, reference) is None else "not_checked"
        for reference in _REFERENCES
    }
    if device_plugin_path is not None:
        profiles["devicePluginConfig"] = _device_plugin_profiles(
            device_plugin_path, document, findings
        )
        references["devicePluginConfig"] = "file"
    if mig_path is not None:
        mig_document, config_map = _config_document(
            mig_path, mig_key(document), "mig-parted config"
        )
        _warn_other_config_map(config_map, document, "migConfig", _name(mig_path), findings)
        profiles["migConfig"] = mig_profiles(mig_document, _name(mig_path), findings)
        references["migConfig"] = "file"
    nodes = [node for path in node_paths for node in _nodes(path)]
    if len(nodes) > MAX_NODES:
        raise _FileFailure(f"more than {MAX_NODES} Nodes in the --node files")
    missing: dict[str, MissingConfig] = {}
    if kubeconfig is not None:
        with _Cluster(kubeconfig) as cluster:
            for reference in _REFERENCES:
                ref = config_map_ref(document, reference)
                if ref is None or references[reference] == "file":
                    continue
                references[reference], profiles[reference], gone = cluster.profiles(ref, findings)
                if gone is not None:
                    missing[reference] = gone
            if cluster_nodes:
                nodes.extend(cluster.nodes(MAX_NODES - len(nodes)))
    validation = validate_sharing(
        document,
        where=_name(sharing_path),
        findings=findings,
        device_plugin=profiles["devicePluginConfig"],
        mig=profiles["migConfig"],
        nodes=nodes,
        missing=missing,
    )
    given = device_plugin_path is not None or mig_path is not None
    if _sets_profiles(document) and not given and kubeconfig is None:
        findings.warnings.insert(
            0,
            f"{_name(sharing_path)}: profile names not checked: give "
            "--device-plugin-config/--mig-config or --kubeconfig (references_not_checked)",
        )
    return {
        "valid": not findings.errors,
        "errors": findings.errors,
        "warnings": findings.warnings,
        "nodes": [_node_result(node, validation) for node in nodes],
        "references": references,
    }


def _sets_profiles(document: object) -> bool:
    """Whether any rule (as written) names a timeSlicing or mig profile."""
    rules = document.get("rules") if isinstance(document, dict) else None
    return any(
        isinstance(rule, dict)
        and (rule.get("timeSlicing") is not None or rule.get("mig") is not None)
        for rule in (rules if isinstance(rules, list) else ())
    )


def _node_result(node: NodeLabels, validation: Validation) -> dict[str, Any]:
    """A node's rule and labels. An invalid config applies nothing (its labels are null), but
    the rule that selects the node is still named where it can be told: a rule that could not
    be read before any that selects it leaves it unknown (``rule_unknown``)."""
    config = validation.config
    if config is None:
        rule, known = select_rule(node.labels, node.name, validation.rules)
        result: dict[str, Any] = {
            "name": node.name,
            "rule": rule,
            "labels": dict.fromkeys(SHARING_LABELS),
            "held": {},
        }
        if not known:
            result["rule_unknown"] = True
        return result
    match = match_node(node.labels, node.name, config)
    return {
        "name": node.name,
        "rule": match.rule,
        "labels": {label: match.labels.get(label) for label in SHARING_LABELS},
        "held": {label: held.reason for label, held in match.held.items()},
    }


# ---------------------------------------------------------------------------------------------
# The cluster (--kubeconfig)


class _Cluster:
    """The ConfigMaps (and Nodes) of the cluster ``kubeconfig`` names, read once each, through
    ``app.ClusterReads`` (imported here only: without ``--kubeconfig`` the command loads no
    Kubernetes client)."""

    def __init__(self, kubeconfig: str) -> None:
        from gpuguard.app import ClusterReads

        try:
            self._reads = ClusterReads(kubeconfig)
        except ConfigError as error:
            raise _FileFailure(f"--kubeconfig: {error}", exit_code=EXIT_USAGE) from None

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reads.close()

    def profiles(
        self, ref: ConfigMapRef, findings: Findings
    ) -> tuple[str, frozenset[str] | None, MissingConfig | None]:
        """How ``ref`` was checked (``cluster``, ``missing``, ``unreadable``), its profiles
        (``None``: not known) and, when the cluster has no such ConfigMap, why."""
        try:
            state = self._reads.config_map(namespace=ref.namespace, name=ref.name)
        except KubeForbidden as error:
            findings.warnings.append(
                f"{config_map_where(ref)}: this kubeconfig may not read it ({error}): its profile "
                "names are not checked (config_map_unreadable)"
            )
            return "unreadable", None, None
        except GpuguardError as error:
            raise _FileFailure(
                f"--kubeconfig: cannot read {config_map_where(ref)}: {error}",
                exit_code=EXIT_USAGE,
            ) from None
        if state.data is None:
            return "missing", None, missing_config_map(ref)
        return "cluster", config_map_profiles(ref, state.data, findings), None

    def nodes(self, most: int) -> list[NodeLabels]:
        try:
            return self._reads.node_labels(most=most)
        except GpuguardError as error:
            raise _FileFailure(f"--cluster-nodes: {error}", exit_code=EXIT_USAGE) from None


# ---------------------------------------------------------------------------------------------
# Files


def _name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def _load(path: str, what: str) -> list[Any]:
    try:
        text = read_bounded(path, max_bytes=MANIFEST_MAX_BYTES, what=what)
        return load_yaml_documents(text, where=_name(path))
    except InputError as error:
        raise _FileFailure(
            str(error), exit_code=EXIT_USAGE if error.unopenable else EXIT_INVALID
        ) from None


def _single(documents: list[Any], where: str, what: str) -> Any:
    present = [d for d in documents if d is not None]
    if len(present) != 1:
        raise _FileFailure(f"{where}: expected one {what} document, found {len(present)}")
    return present[0]


def _is_config_map(document: object) -> bool:
    return isinstance(document, dict) and document.get("kind") == "ConfigMap"


def _config_map_data(document: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    data = document.get("data")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _FileFailure(f"{where}: the ConfigMap's data is not a mapping")
    return data


def _config_document(path: str, key: str, what: str) -> tuple[Any, Mapping[str, Any] | None]:
    """The config in ``path`` (a ConfigMap's ``key``, loaded, or the raw file's one document)
    and the ConfigMap it came from (``None`` for a raw file)."""
    where = _name(path)
    document = _single(_load(path, what), where, what)
    if not _is_config_map(document):
        return document, None
    data = _config_map_data(document, where)
    at = f"{where}: data[{key!r}]"
    try:
        return single_document(data_value(data, key, where), at, what), document
    except DocumentError as error:
        raise _FileFailure(str(error)) from None


def _warn_other_config_map(
    config_map: Mapping[str, Any] | None,
    sharing_document: object,
    reference: str,
    where: str,
    findings: Findings,
) -> None:
    """Warn when the ConfigMap given is not the one the sharing config names: the agent reads
    that one, so a check against another proves nothing about it."""
    if config_map is None or not isinstance(sharing_document, dict):
        return
    named = sharing_document.get(reference)
    metadata = config_map.get("metadata")
    if not isinstance(named, dict) or not isinstance(metadata, dict):
        return
    for field in ("namespace", "name"):
        given, wanted = metadata.get(field), named.get(field)
        if isinstance(given, str) and isinstance(wanted, str) and given != wanted:
            findings.warnings.append(
                f"{where}: the ConfigMap's {field} is {shorten(given)} but the sharing config's "
                f"{reference}.{field} is {shorten(wanted)}: the agent will read that one "
                "(other_config_map)"
            )


def _device_plugin_profiles(
    path: str, sharing_document: object, findings: Findings
) -> frozenset[str]:
    """The profile names of the device plugin's configs, each checked as the plugin would."""
    where = _name(path)
    document = _single(_load(path, "device-plugin config"), where, "device-plugin config")
    if not _is_config_map(document):
        profile = os.path.basename(where)
        for suffix in (".yaml", ".yml"):
            profile = profile.removesuffix(suffix)
        checked = check_device_plugin_config(document)
        findings.add(checked.errors, checked.warnings, f"{where}: ")
        return frozenset([profile])
    _warn_other_config_map(document, sharing_document, "devicePluginConfig", where, findings)
    try:
        return device_plugin_profiles(_config_map_data(document, where), where, findings)
    except DocumentError as error:
        raise _FileFailure(str(error)) from None


def _nodes(path: str) -> Iterator[NodeLabels]:
    where = _name(path)
    for number, document in enumerate(_load(path, "Node file"), start=1):
        if document is None:
            continue
        at = f"{where}: document {number}"
        if isinstance(document, dict) and _is_list(document):
            items = document.get("items") or []
            if not isinstance(items, list):
                raise _FileFailure(f"{at}: items is not a list")
            for index, item in enumerate(items):
                yield _node(item, f"{at} item {index}")
        else:
            yield _node(document, at)


def _is_list(document: Mapping[str, Any]) -> bool:
    kind = document.get("kind")
    return isinstance(kind, str) and kind.endswith("List")


def _node(raw: object, where: str) -> NodeLabels:
    if not isinstance(raw, dict) or raw.get("kind") != "Node":
        raise _FileFailure(f"{where}: not a Node (kind: Node, or a List of Nodes)")
    metadata = raw.get("metadata")
    if not isinstance(metadata, dict):
        raise _FileFailure(f"{where}: the Node has no metadata mapping")
    name = metadata.get("name")
    problem = dns_subdomain_problem(name, "the Node's name")
    if problem is not None:
        raise _FileFailure(f"{where}: {problem}")
    labels = metadata.get("labels") or {}
    if not isinstance(labels, dict) or len(labels) > MAX_NODE_LABELS:
        raise _FileFailure(
            f"{where}: metadata.labels must be a mapping of at most {MAX_NODE_LABELS} labels"
        )
    for key, value in labels.items():
        if label_key_problem(key) is not None or not isinstance(value, str):
            raise _FileFailure(f"{where}: label {shorten(key)} is not a valid string label")
    assert isinstance(name, str)
    return NodeLabels(name=name, labels=labels)


# ---------------------------------------------------------------------------------------------
# Human output


def _print_report(result: Mapping[str, Any], sharing_path: str, out: TextIO) -> None:
    """The verdict, the errors and warnings, then a row per Node. Every line and cell is escaped
    (``core.text.printable``): file names, rule and profile names and the values the findings
    quote come from files (and a cluster) others write; columns are padded by the cells the
    escaped text takes (``core.text.pad``)."""
    verdict = "valid" if result["valid"] else "INVALID"
    unchecked = [
        f"{reference}: {how.replace('_', ' ')}"
        for reference, how in result["references"].items()
        if how not in (None, "file", "cluster")
    ]
    if unchecked:
        verdict += f" ({', '.join(unchecked)})"
    out.write(printable(f"{_name(sharing_path)}: {verdict}") + "\n")
    for heading, items in (("errors", result["errors"]), ("warnings", result["warnings"])):
        if items:
            out.write(f"{heading}:\n")
            out.writelines(f"  - {printable(item)}\n" for item in items)
    if not result["nodes"]:
        return
    if not result["valid"]:
        out.write(
            "nodes (what the rules select; the config is invalid: nothing would be applied):\n"
        )
    rows: list[tuple[str, ...]] = [("NODE", "RULE", DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL)]
    for node in result["nodes"]:
        labels, held = node["labels"], node["held"]
        unchanged = "(unchanged)" if result["valid"] else "(not applied)"
        cells = [
            labels[label] or ("(held: ConfigMap missing)" if label in held else unchanged)
            for label in (DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL)
        ]
        rule = node["rule"] or (
            "(unknown: a rule before could not be read)"
            if node.get("rule_unknown")
            else "(no rule)"
        )
        rows.append(tuple(printable(c) for c in (node["name"], rule, *cells)))
    widths = [max(display_width(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [pad(cell, width) for cell, width in zip(row[:3], widths, strict=True)]
        out.write("  ".join([*cells, row[3]]).rstrip() + "\n")
