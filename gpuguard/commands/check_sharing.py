"""``gpuguard check-sharing``: validate a sharing config (DESIGN §5.3) before it is applied.

Owns the DESIGN §5.2 ``check-sharing`` contract: one JSON document ``{"valid", "errors",
"warnings", "nodes"}``; ``nodes`` has one entry per Node in the ``--node`` files, in order, with
``name``, ``rule`` (the first rule that matches, or null) and ``labels``, an object that always
holds both ``nvidia.com/device-plugin.config`` and ``nvidia.com/mig.config``: the value the rule
sets, or **null when that label is left alone** (the rule omits the key, no rule matches, or the
sharing config is invalid: an invalid config changes nothing). Errors and warnings are strings,
``"<where>: <what> (<code>)"``, the code a stable snake_case name (``core.problems``).

Reads every file through ``adapters.manifest`` (bounded, safe YAML). Each FILE is a ConfigMap
manifest or the raw config: the sharing config's key is ``sharing.yaml``; the device plugin's
ConfigMap has one profile per data key (a raw file is one profile named after the file, without
``.yaml``/``.yml``); mig-parted's key is ``migConfig.key`` (default ``config.yaml``). A
ConfigMap other than the one the sharing config names is a warning (``other_config_map``). A
Node file holds Nodes or a List of them; the Nodes also go to validation, so that the warning
about a rule that selects every node (``selects_every_node``) says how many it gets. Exit 0
valid; 1 invalid (an error in any config, or a file that is not UTF-8, binary, too large, hostile
or of the wrong shape: one line on stderr); 2 a file that cannot be opened. Must not talk to a
cluster: the result depends only on the files.
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
    data_value,
    device_plugin_profiles,
    mig_key,
    mig_profiles,
    single_document,
    validate_sharing,
)
from gpuguard.core.nvidia_configs import check_device_plugin_config
from gpuguard.core.selector import dns_subdomain_problem, label_key_problem
from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    SHARING_LABELS,
    NodeLabels,
    SharingConfig,
    desired_labels,
)
from gpuguard.errors import GpuguardError

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

MAX_NODES = 10_000
"""Most Nodes read from the ``--node`` files together."""
MAX_NODE_LABELS = 1024
"""Most labels on one Node read."""

_PROG = "gpuguard check-sharing"


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
) -> int:
    """The CLI entry: check the files, print JSON or a report, return the exit code."""
    err = sys.stderr if stderr is None else stderr
    try:
        result = check_sharing(
            sharing_path=sharing_path,
            device_plugin_path=device_plugin_path,
            mig_path=mig_path,
            node_paths=node_paths,
        )
    except _FileFailure as failure:
        print(f"{_PROG}: {failure}", file=err)
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
) -> dict[str, Any]:
    """The DESIGN §5.2 object for these files. Raises ``_FileFailure`` for an unusable file."""
    findings = Findings()
    document, _ = _config_document(sharing_path, SHARING_KEY, "sharing config")
    device_plugin = None
    if device_plugin_path is not None:
        device_plugin = _device_plugin_profiles(device_plugin_path, document, findings)
    mig = None
    if mig_path is not None:
        mig_document, config_map = _config_document(
            mig_path, mig_key(document), "mig-parted config"
        )
        _warn_other_config_map(config_map, document, "migConfig", _name(mig_path), findings)
        mig = mig_profiles(mig_document, _name(mig_path), findings)
    nodes = [node for path in node_paths for node in _nodes(path)]
    if len(nodes) > MAX_NODES:
        raise _FileFailure(f"more than {MAX_NODES} Nodes in the --node files")
    validation = validate_sharing(
        document,
        where=_name(sharing_path),
        findings=findings,
        device_plugin=device_plugin,
        mig=mig,
        nodes=nodes,
    )
    return {
        "valid": not findings.errors,
        "errors": findings.errors,
        "warnings": findings.warnings,
        "nodes": [_node_result(node, validation.config) for node in nodes],
    }


def _node_result(node: NodeLabels, config: SharingConfig | None) -> dict[str, Any]:
    rule, labels = desired_labels(node.labels, node.name, config) if config else (None, {})
    return {
        "name": node.name,
        "rule": rule,
        "labels": {label: labels.get(label) for label in SHARING_LABELS},
    }


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
    verdict = "valid" if result["valid"] else "INVALID"
    out.write(f"{_name(sharing_path)}: {verdict}\n")
    for heading, items in (("errors", result["errors"]), ("warnings", result["warnings"])):
        if items:
            out.write(f"{heading}:\n")
            out.writelines(f"  - {item}\n" for item in items)
    if not result["nodes"]:
        return
    if not result["valid"]:
        out.write(
            "nodes (what the rules select; the config is invalid: nothing would be applied):\n"
        )
    rows = [("NODE", "RULE", DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL)]
    for node in result["nodes"]:
        labels = node["labels"]
        rows.append(
            (
                node["name"],
                node["rule"] or "(no rule)",
                labels[DEVICE_PLUGIN_CONFIG_LABEL] or "(unchanged)",
                labels[MIG_CONFIG_LABEL] or "(unchanged)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
        out.write("  ".join([*cells, row[3]]).rstrip() + "\n")
