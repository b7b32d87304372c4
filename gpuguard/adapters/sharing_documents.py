"""The sharing config and NVIDIA's two configs, from ConfigMap data: one reading for the agent
(ConfigMaps from the API server) and ``check-sharing`` (ConfigMaps from files, or from the
cluster with ``--kubeconfig``).

Owns how a ConfigMap's ``data`` becomes what ``core.sharing`` validates: the ``sharing.yaml``
document, the device plugin's profiles (every data key one config, each checked as the plugin
checks it), mig-parted's profiles (the ``mig-configs`` of its key), a referenced ConfigMap that
does not exist (``core.sharing.MissingConfig``), every problem rendered as
``"<where>: <what> (<code>)"``. Every value is hostile input: YAML goes through
``adapters.manifest`` (bounded, safe). Must not import the ``kubernetes`` client or read files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.adapters.manifest import InputError, load_yaml_documents, shorten
from gpuguard.core.nvidia_configs import (
    MAX_PROFILES,
    check_device_plugin_config,
    check_mig_parted_config,
)
from gpuguard.core.problems import Problem
from gpuguard.core.sharing import (
    DEFAULT_MIG_CONFIG_KEY,
    ConfigMapRef,
    MissingConfig,
    NodeLabels,
    Validation,
    parse_sharing,
)

SHARING_KEY = "sharing.yaml"
"""The data key of the sharing config in its ConfigMap (``gpuguard-sharing``)."""


class DocumentError(InputError):
    """A ConfigMap value that cannot be read as one YAML document (the whole input is unusable)."""


@dataclass(slots=True)
class Findings:
    """Errors and warnings, rendered, from every document read."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, errors: tuple[Problem, ...] | list[Problem], warnings: Any, prefix: str) -> None:
        self.errors.extend(f"{prefix}{p}" for p in errors)
        self.warnings.extend(f"{prefix}{p}" for p in warnings)


def single_document(text: str, where: str, what: str) -> Any:
    """The one YAML document of ``text``; raises ``DocumentError`` otherwise."""
    try:
        documents = load_yaml_documents(text, where=where)
    except InputError as error:
        raise DocumentError(str(error)) from None
    present = [d for d in documents if d is not None]
    if len(present) != 1:
        raise DocumentError(f"{where}: expected one {what} document, found {len(present)}")
    return present[0]


def data_value(data: Mapping[str, Any], key: str, where: str) -> str:
    """``data[key]`` as text; raises ``DocumentError`` naming the keys there are."""
    text = data.get(key)
    if not isinstance(text, str):
        keys = ", ".join(shorten(k) for k in list(data)[:8]) or "none"
        raise DocumentError(f"{where}: the ConfigMap has no data key {key!r} (its keys: {keys})")
    return text


def device_plugin_profiles(
    data: Mapping[str, Any], where: str, findings: Findings
) -> frozenset[str]:
    """The device plugin ConfigMap's profile names (its data keys), each value checked as the
    plugin would check it (problems go to ``findings``). Raises ``DocumentError`` for more than
    ``MAX_PROFILES`` keys."""
    if len(data) > MAX_PROFILES:
        raise DocumentError(f"{where}: more than {MAX_PROFILES} data keys")
    profiles = []
    for key, text in data.items():
        at = f"{where}: data[{shorten(key)}]"
        if not isinstance(key, str) or not isinstance(text, str):
            findings.errors.append(f"{at}: a ConfigMap's data maps strings to strings (wrong_type)")
            continue
        profiles.append(key)
        try:
            document = single_document(text, at, "config")
        except DocumentError as error:
            findings.errors.append(f"{error} (invalid_yaml)")
            continue
        checked = check_device_plugin_config(document)
        findings.add(checked.errors, checked.warnings, f"{at}: ")
    return frozenset(profiles)


def mig_profiles(document: object, where: str, findings: Findings) -> frozenset[str]:
    """mig-parted's profile names (``mig-configs``), the config checked as mig-parted would."""
    checked, profiles = check_mig_parted_config(document)
    findings.add(checked.errors, checked.warnings, f"{where}: ")
    return profiles


def config_map_where(ref: ConfigMapRef) -> str:
    """``configmap <namespace>/<name>``: where a problem of a referenced ConfigMap is."""
    return f"configmap {ref.namespace}/{ref.name}"


def config_map_profiles(
    ref: ConfigMapRef, data: Mapping[str, Any], findings: Findings
) -> frozenset[str]:
    """The profiles of the NVIDIA ConfigMap ``ref`` names, from its ``data`` as the API server
    holds it (the agent's watch; ``check-sharing --kubeconfig``): every data key for the device
    plugin (``ref.key`` is ``None``), the ``mig-configs`` of ``ref.key`` for mig-parted. A
    config NVIDIA would reject goes to ``findings``; one that cannot be read at all (no such key,
    not YAML) too, with no profiles: every rule naming one of them is then an error."""
    where = config_map_where(ref)
    try:
        if ref.key is None:
            return device_plugin_profiles(data, where, findings)
        at = f"{where}: data[{ref.key!r}]"
        document = single_document(data_value(data, ref.key, where), at, "mig-parted")
        return mig_profiles(document, at, findings)
    except DocumentError as error:
        findings.errors.append(f"{error} (invalid_config)")
        return frozenset()


def missing_config_map(ref: ConfigMapRef) -> MissingConfig:
    """A referenced ConfigMap the API server does not have."""
    return MissingConfig(code="config_map_missing", detail=f"{config_map_where(ref)} is not found")


def mig_key(sharing_document: object) -> str:
    """mig-parted's data key as the sharing config names it (``migConfig.key``)."""
    if isinstance(sharing_document, dict):
        reference = sharing_document.get("migConfig")
        if isinstance(reference, dict) and isinstance(reference.get("key"), str):
            key: str = reference["key"]
            return key
    return DEFAULT_MIG_CONFIG_KEY


def config_map_ref(sharing_document: object, reference: str) -> ConfigMapRef | None:
    """Where the sharing config says one of NVIDIA's configs lives (``devicePluginConfig`` or
    ``migConfig``), read leniently: ``None`` when it is absent or malformed (``parse_sharing``
    reports that)."""
    if not isinstance(sharing_document, dict):
        return None
    raw = sharing_document.get(reference)
    if not isinstance(raw, dict):
        return None
    namespace, name = raw.get("namespace"), raw.get("name")
    if not (isinstance(namespace, str) and namespace and isinstance(name, str) and name):
        return None
    key = mig_key(sharing_document) if reference == "migConfig" else None
    return ConfigMapRef(namespace=namespace, name=name, key=key)


def validate_sharing(
    sharing_document: object,
    *,
    where: str,
    findings: Findings,
    device_plugin: frozenset[str] | None,
    mig: frozenset[str] | None,
    nodes: Sequence[NodeLabels] | None = None,
    missing: Mapping[str, MissingConfig] | None = None,
) -> Validation:
    """``parse_sharing`` with the profiles (and Nodes, and the referenced ConfigMaps that cannot
    be read) known; its problems go to ``findings``."""
    validation = parse_sharing(
        sharing_document,
        device_plugin_profiles=device_plugin,
        mig_profiles=mig,
        nodes=nodes,
        missing=missing,
    )
    findings.add(validation.errors, validation.warnings, f"{where}: ")
    return validation
