"""NVIDIA's two sharing configs, validated as NVIDIA's own parsers accept and reject them.

Owns the rules of the device plugin's config file (``api/config/v1``: one file per data key of
its ConfigMap, the key being the profile a node selects with ``nvidia.com/device-plugin.config``)
and of mig-parted's config (``api/spec/v1``: ``mig-configs`` name → list of device specs, a name
being what ``nvidia.com/mig.config`` selects). The rules are those observed by compiling NVIDIA's
parsers (each rule's case is a row of ``tests/test_nvidia_configs.py``) and read in their public
source (device plugin ``api/config/v1/{config,replicas,resources}.go``; mig-parted
``api/spec/v1/spec.go``, ``pkg/types/mig_{config,profile}.go``):

- device plugin: decoded through ``sigs.k8s.io/yaml`` into Go structs, so unknown keys are
  ignored (reported here as warnings) and struct fields match case-insensitively; ``version``
  empty means ``v1``, anything else but ``v1`` is an error; ``sharing.timeSlicing`` (and
  ``sharing.mps``) need a non-empty ``resources`` list whose entries need ``name`` (``gpu`` is
  normalised to ``nvidia.com/gpu``; at most 63 characters once qualified, a lowercase
  DNS subdomain after ``nvidia.com/``) and ``replicas``
  (an integer ≥ 2); ``devices`` is ``all``, a count > 0 or a list of indices, ``i:j`` MIG
  indices or ``GPU-``/``MIG-`` UUIDs; ``timeSlicing: null`` is still unmarshalled (no resources).
- mig-parted: strict: ``version`` (``v1``) required, ``mig-configs`` optional but not empty,
  any other key an error; each config a non-empty list of
  ``{devices, mig-enabled, mig-devices, device-filter}``;
  ``devices`` ``all`` or a list of indices; ``mig-enabled`` a boolean; ``mig-devices`` required
  when enabled and empty when not, keys ``[<c>c.]<g>g.<m>gb[+attr[,attr]]``, counts integers
  ≥ 0 and not all zero.

Pure: takes loaded YAML (``adapters.manifest`` reads and loads it), returns ``Problem``s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.core.problems import Problem, Problems, shown, type_name

DEVICE_PLUGIN_VERSION = "v1"
MIG_PARTED_VERSION = "v1"
MAX_PROFILES = 1024
"""Most device-plugin profiles (ConfigMap keys) or mig-parted configs read."""
MAX_ENTRIES = 1024
"""Most resources of a time-slicing config, device specs of a MIG config, or list items."""
MAX_REPLICAS = 1 << 31
"""Go's ``int`` is 64-bit, but no GPU is shared by more than this; bounds the message."""
_RESOURCE_PREFIX = "nvidia.com"
_RESOURCE_NAME_MAX = 63
_MIG_STRATEGIES = ("none", "single", "mixed")
_MIG_PROFILE = re.compile(
    r"([0-9]+c\.)?[0-9]+g\.[0-9]+gb(\+(?P<attributes>.*))?", re.ASCII | re.DOTALL
)
_MIG_ATTRIBUTE = re.compile(r"[A-Za-z][A-Za-z0-9]*", re.ASCII)
_UINT = r"[0-9]{1,19}"
_UUID = (
    r"(?:[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|(?i:urn:uuid:)[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|\{[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\}"
    r"|[0-9a-fA-F]{32})"
)
_DEVICE_REF = re.compile(
    rf"{_UINT}|{_UINT}:{_UINT}|GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/{_UINT}/{_UINT}", re.ASCII
)
"""A device reference in ``devices: [...]`` (``replicas.go``): a GPU index, a MIG index ``i:j``,
a GPU UUID, or a MIG UUID in either form, UUIDs in the forms ``github.com/google/uuid`` parses."""
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    """What a config's check found."""

    errors: tuple[Problem, ...]
    warnings: tuple[Problem, ...]


class _Report(Problems):
    def done(self) -> Checked:
        return Checked(errors=tuple(self.errors), warnings=tuple(self.warnings))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fold(raw: Mapping[object, object], fields: tuple[str, ...]) -> dict[str, object]:
    """A Go struct's view of a JSON object: field names match case-insensitively, the last
    matching key wins (``encoding/json``); other keys are dropped."""
    found: dict[str, object] = {}
    for key, value in raw.items():
        for name in fields:
            if isinstance(key, str) and key.lower() == name.lower():
                found[name] = value
    return found


def _ignored(raw: Mapping[object, object], fields: tuple[str, ...], path: str, r: _Report) -> None:
    for key in raw:
        if not (isinstance(key, str) and key.lower() in {f.lower() for f in fields}):
            r.warn(
                "ignored_key",
                path,
                f"unknown key {shown(key)}: NVIDIA's parser ignores it (a misspelling?)",
            )


# ---------------------------------------------------------------------------------------------
# Device plugin


def check_device_plugin_config(document: object, *, path: str = "") -> Checked:
    """Whether the device plugin would load ``document`` (one profile's config file)."""
    r = _Report()
    if not isinstance(document, dict):
        r.error(
            "wrong_type",
            path,
            f"a device-plugin config must be a mapping, not {type_name(document)}",
        )
        return r.done()
    top = _fold(document, ("version", "flags", "sharing", "resources", "imex"))
    _ignored(document, ("version", "flags", "sharing", "resources", "imex"), path, r)
    version = top.get("version")
    if version is not None and not isinstance(version, str):
        r.error("wrong_type", _at(path, "version"), f"must be a string, not {type_name(version)}")
    elif version not in (None, "", DEVICE_PLUGIN_VERSION):
        r.error("unknown_version", _at(path, "version"), f"unknown version {shown(version)} (v1)")
    _flags(top.get("flags"), _at(path, "flags"), r)
    sharing = top.get("sharing")
    if sharing is not None:
        if isinstance(sharing, dict):
            fields = ("timeSlicing", "mps")
            _ignored(sharing, fields, _at(path, "sharing"), r)
            for name, value in _fold(sharing, fields).items():
                if value is not None or name == "timeSlicing":
                    # timeSlicing is a struct value: Go calls its UnmarshalJSON even for null.
                    _replicated(value, _at(path, f"sharing.{name}"), r)
        else:
            r.error(
                "wrong_type", _at(path, "sharing"), f"must be a mapping, not {type_name(sharing)}"
            )
    return r.done()


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _flags(flags: object, path: str, r: _Report) -> None:
    if flags is None:
        return
    if not isinstance(flags, dict):
        r.error("wrong_type", path, f"must be a mapping, not {type_name(flags)}")
        return
    strategy = _fold(flags, ("migStrategy",)).get("migStrategy")
    if strategy is not None and strategy not in _MIG_STRATEGIES:
        r.error(
            "invalid_mig_strategy",
            f"{path}.migStrategy",
            f"{shown(strategy)} is not a MIG strategy (none, single, mixed): the plugin exits",
        )


def _replicated(raw: object, path: str, r: _Report) -> None:
    if raw is None:
        r.error("no_resources", f"{path}.resources", "no resources specified")
        return
    if not isinstance(raw, dict):
        r.error("wrong_type", path, f"must be a mapping, not {type_name(raw)}")
        return
    for flag in ("renameByDefault", "failRequestsGreaterThanOne"):
        if raw.get(flag) is not None and not isinstance(raw[flag], bool):
            r.error(
                "wrong_type", f"{path}.{flag}", f"must be a boolean, not {type_name(raw[flag])}"
            )
    resources = raw.get("resources")
    if resources is not None and not isinstance(resources, list):
        r.error("wrong_type", f"{path}.resources", f"must be a list, not {type_name(resources)}")
        return
    if not resources:
        r.error("no_resources", f"{path}.resources", "no resources specified")
        return
    if len(resources) > MAX_ENTRIES:
        r.error("too_many", f"{path}.resources", f"more than {MAX_ENTRIES} resources")
        return
    for index, resource in enumerate(resources):
        _resource(resource, f"{path}.resources[{index}]", r)


def _resource(raw: object, path: str, r: _Report) -> None:
    if not isinstance(raw, dict):
        r.error("wrong_type", path, f"must be a mapping, not {type_name(raw)}")
        return
    for key in ("name", "rename"):
        if key in raw:
            _resource_name(raw[key], f"{path}.{key}", r)
        elif key == "name":
            r.error("missing_key", f"{path}.name", "missing 'name'")
    if "replicas" not in raw:
        r.error("no_replicas", f"{path}.replicas", "no replicas specified")
    else:
        replicas = raw["replicas"]
        if not _is_int(replicas):
            r.error(
                "wrong_type", f"{path}.replicas", f"must be an integer, not {type_name(replicas)}"
            )
        elif not 2 <= replicas <= MAX_REPLICAS:
            r.error(
                "invalid_replicas",
                f"{path}.replicas",
                f"number of replicas must be >= 2, not {replicas}",
            )
    if "devices" in raw:
        _devices(raw["devices"], f"{path}.devices", r)


def _resource_name(raw: object, path: str, r: _Report) -> None:
    if not isinstance(raw, str):
        r.error("wrong_type", path, f"must be a string, not {type_name(raw)}")
        return
    qualified = raw if raw.startswith(f"{_RESOURCE_PREFIX}/") else f"{_RESOURCE_PREFIX}/{raw}"
    if len(qualified) > _RESOURCE_NAME_MAX:
        r.error(
            "invalid_resource_name",
            path,
            f"fully-qualified resource name must be {_RESOURCE_NAME_MAX} characters or less: "
            f"{shown(qualified)}",
        )
    elif _DNS_SUBDOMAIN.fullmatch(qualified.split("/", 1)[1]) is None:
        r.error(
            "invalid_resource_name",
            path,
            f"incorrect format for resource name {shown(qualified)}: after nvidia.com/ it must "
            "be a lowercase DNS subdomain",
        )


def _devices(raw: object, path: str, r: _Report) -> None:
    if isinstance(raw, str):
        if raw != "all":
            r.error(
                "invalid_devices",
                path,
                f"devices set as {shown(raw)} but the only valid string input is 'all'",
            )
    elif _is_int(raw):
        assert isinstance(raw, int)
        if raw <= 0:
            r.error(
                "invalid_devices", path, f"devices set as {raw} but a count of devices must be > 0"
            )
    elif isinstance(raw, list):
        if len(raw) > MAX_ENTRIES:
            r.error("too_many", path, f"more than {MAX_ENTRIES} devices")
            return
        for index, ref in enumerate(raw):
            ok = (_is_int(ref) and 0 <= ref < 1 << 64) or (
                isinstance(ref, str) and _DEVICE_REF.fullmatch(ref)
            )
            if not ok:
                r.error(
                    "invalid_devices",
                    f"{path}[{index}]",
                    f"unrecognized device reference {shown(ref)}",
                )
    else:
        r.error("invalid_devices", path, f"unrecognized type for devices spec: {type_name(raw)}")


# ---------------------------------------------------------------------------------------------
# mig-parted


def check_mig_parted_config(document: object, *, path: str = "") -> tuple[Checked, frozenset[str]]:
    """Whether mig-parted would load ``document``, and the names of its MIG configs."""
    r = _Report()
    if not isinstance(document, dict):
        r.error(
            "wrong_type", path, f"a mig-parted config must be a mapping, not {type_name(document)}"
        )
        return r.done(), frozenset()
    if "version" not in document:
        r.error("missing_key", _at(path, "version"), "missing version field")
    elif document["version"] != MIG_PARTED_VERSION:
        r.error(
            "unknown_version",
            _at(path, "version"),
            f"unknown version {shown(document['version'])} (v1)",
        )
    for key in document:
        if key not in ("version", "mig-configs"):
            r.error("unknown_key", _at(path, str(key)), f"unexpected field {shown(key)}")
    if "mig-configs" not in document:
        return r.done(), frozenset()  # mig-parted accepts a config without any
    configs = document["mig-configs"]
    if not isinstance(configs, dict):
        r.error(
            "wrong_type", _at(path, "mig-configs"), f"must be a mapping, not {type_name(configs)}"
        )
        return r.done(), frozenset()
    if not configs:
        r.error(
            "empty_mig_configs",
            _at(path, "mig-configs"),
            "at least one entry in 'mig-configs' is required",
        )
    if len(configs) > MAX_PROFILES:
        r.error("too_many", _at(path, "mig-configs"), f"more than {MAX_PROFILES} configs")
        return r.done(), frozenset()
    names = []
    for name, specs in configs.items():
        where = _at(path, f"mig-configs[{shown(name)}]")
        if not isinstance(name, str):
            r.error("wrong_type", where, f"a config name must be a string, not {type_name(name)}")
            continue
        names.append(name)
        _mig_config(specs, where, r)
    return r.done(), frozenset(names)


def _mig_config(specs: object, path: str, r: _Report) -> None:
    if not isinstance(specs, list):
        r.error("wrong_type", path, f"must be a list of device specs, not {type_name(specs)}")
        return
    if not specs:
        r.error("empty_mig_config", path, "at least one entry is required")
    if len(specs) > MAX_ENTRIES:
        r.error("too_many", path, f"more than {MAX_ENTRIES} device specs")
        return
    for index, spec in enumerate(specs):
        _mig_spec(spec, f"{path}[{index}]", r)


_SPEC_KEYS = ("device-filter", "devices", "mig-enabled", "mig-devices")


def _mig_spec(spec: object, path: str, r: _Report) -> None:
    if not isinstance(spec, dict):
        r.error("wrong_type", path, f"must be a mapping, not {type_name(spec)}")
        return
    for key in spec:
        if key not in _SPEC_KEYS:
            r.error("unknown_key", path, f"unexpected field {shown(key)}")
    _device_filter(spec.get("device-filter"), f"{path}.device-filter", r)
    if "devices" not in spec:
        r.error("missing_key", f"{path}.devices", "missing required field 'devices'")
    else:
        _mig_devices_list(spec["devices"], f"{path}.devices", r)
    enabled = spec.get("mig-enabled")  # null: Go leaves the bool false
    if "mig-enabled" not in spec:
        r.error("missing_key", f"{path}.mig-enabled", "missing required field 'mig-enabled'")
    elif enabled is not None and not isinstance(enabled, bool):
        r.error("wrong_type", f"{path}.mig-enabled", f"must be a boolean, not {type_name(enabled)}")
        return
    profiles = spec.get("mig-devices")  # null: Go sets the map to nil, as if missing
    if profiles is not None:
        _mig_profiles(profiles, f"{path}.mig-devices", r)
    if enabled is True and profiles is None:
        r.error(
            "missing_key",
            f"{path}.mig-devices",
            "missing required field 'mig-devices' when mig-enabled is true",
        )
    elif not enabled and profiles:
        r.error(
            "unexpected_mig_devices",
            f"{path}.mig-devices",
            "MIG devices included when mig-enabled is false",
        )


def _device_filter(raw: object, path: str, r: _Report) -> None:
    if raw is None or isinstance(raw, str):
        return
    if (
        isinstance(raw, list)
        and len(raw) <= MAX_ENTRIES
        and all(x is None or isinstance(x, str) for x in raw)
    ):
        return
    r.error("wrong_type", path, "must be a string or a list of strings (PCI device IDs)")


def _mig_devices_list(raw: object, path: str, r: _Report) -> None:
    if raw == "all":
        return
    if isinstance(raw, list) and len(raw) <= MAX_ENTRIES and all(_is_int(x) for x in raw):
        return
    r.error(
        "invalid_devices", path, f"devices must be 'all' or a list of GPU indices, not {shown(raw)}"
    )


def _mig_profiles(raw: object, path: str, r: _Report) -> None:
    if not isinstance(raw, dict):
        r.error(
            "wrong_type", path, f"must be a mapping of MIG profile to count, not {type_name(raw)}"
        )
        return
    if len(raw) > MAX_ENTRIES:
        r.error("too_many", path, f"more than {MAX_ENTRIES} profiles")
        return
    counts = []
    for profile, raw_count in raw.items():
        count = 0 if raw_count is None else raw_count  # null: Go leaves the int 0
        where = f"{path}[{shown(profile)}]"
        if not _is_mig_profile(profile):
            r.error(
                "invalid_mig_profile",
                where,
                f"{shown(profile)} is not a MIG profile (<n>g.<m>gb, e.g. 1g.5gb or 1g.5gb+me)",
            )
        if not _is_int(count) or count < 0:
            r.error("invalid_count", where, f"a count must be an integer >= 0, not {shown(count)}")
        else:
            counts.append(count)
    if raw and counts and len(counts) == len(raw) and not any(counts):
        r.error("invalid_count", path, "every count is zero")


def _is_mig_profile(profile: object) -> bool:
    """mig-parted's ``ParseMigProfile`` format: ``[<c>c.]<g>g.<gb>gb``, then optionally ``+``
    and unique, non-empty, comma-separated attributes of letters and digits (``1g.5gb+me``)."""
    if not isinstance(profile, str):
        return False
    match = _MIG_PROFILE.fullmatch(profile)
    if match is None:
        return False
    attributes = match.group("attributes")
    if attributes is None:
        return True
    names = attributes.split(",")
    return len(set(names)) == len(names) and all(_MIG_ATTRIBUTE.fullmatch(a) for a in names)
