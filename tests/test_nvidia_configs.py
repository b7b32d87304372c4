"""core.nvidia_configs: accept and reject what NVIDIA's device plugin and mig-parted parsers do.

The rules are those observed by compiling NVIDIA's parsers and read in mig-parted's
``api/spec/v1/spec.go`` and ``pkg/types``; NVIDIA's Go modules are not served here, so the tables
are the spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.nvidia_configs import check_device_plugin_config, check_mig_parted_config
from tests.helpers.documents import nested_documents

# NVIDIA's mig-parted examples/config.yaml, verbatim (NVIDIA/mig-parted, read from the public
# repository's examples/config.yaml): tests/fixtures/nvidia/mig-parted-example.yaml.
NVIDIA_EXAMPLE_MIG_CONFIG = (
    Path(__file__).parent / "fixtures" / "nvidia" / "mig-parted-example.yaml"
).read_text()

# gpu-operator's time-slicing example (its docs' "time-slicing-config" ConfigMap, one profile).
TIME_SLICING = """\
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def dp(text: str) -> tuple[set[str], set[str]]:
    checked = check_device_plugin_config(yaml.safe_load(text))
    return {p.code for p in checked.errors}, {p.code for p in checked.warnings}


def ts(resource: str, extra: str = "") -> str:
    return f"version: v1\n{extra}sharing:\n  timeSlicing:\n    resources:\n    - {resource}\n"


GPU_UUID = "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763"
MIG_UUID = "MIG-b1028956-cfa2-0990-bf4a-5da9abb51763"

DEVICE_PLUGIN_VALID = [
    TIME_SLICING,
    "version: v1\n",
    "flags: {migStrategy: mixed}\n",  # no version: the plugin defaults it to v1
    'version: ""\n',
    ts("{name: gpu, replicas: 2}"),
    ts("{name: nvidia.com/gpu, replicas: 10, devices: all}"),
    ts("{name: gpu, replicas: 3, devices: 2}"),
    ts("{name: gpu, replicas: 3, devices: [0, '1', '0:1', " + GPU_UUID + ", " + MIG_UUID + "]}"),
    ts("{name: gpu, replicas: 3, devices: ['MIG-" + GPU_UUID + "/3/0']}"),
    ts("{name: gpu, replicas: 2, renameByDefault: null}"),
    ts("{name: nvidia.com/mig-1g.5gb, replicas: 2}"),
    ts("{name: nvidia.com/mig-1g.5gb, replicas: 2, rename: shared-1g}"),
    "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 4}\n",
    "version: v1\nsharing: {}\n",
]


@pytest.mark.parametrize("text", DEVICE_PLUGIN_VALID)
def test_accepts_what_the_device_plugin_accepts(text: str) -> None:
    errors, _ = dp(text)
    assert errors == set()


DEVICE_PLUGIN_INVALID = [
    ("version: v2\n", "unknown_version"),
    ("version: 1\n", "wrong_type"),
    ("- a list\n", "wrong_type"),
    (ts("{name: gpu, replicas: 1}"), "invalid_replicas"),
    (ts("{name: gpu, replicas: 0}"), "invalid_replicas"),
    (ts("{name: gpu, replicas: -4}"), "invalid_replicas"),
    (ts("{name: gpu, replicas: '4'}"), "wrong_type"),
    (ts("{name: gpu, replicas: 2.5}"), "wrong_type"),
    (ts("{name: gpu, replica: 4}"), "no_replicas"),  # the misspelling NVIDIA reports so
    (ts("{replicas: 4}"), "missing_key"),
    (ts("{name: 4, replicas: 4}"), "wrong_type"),
    (ts("{name: " + "x" * 60 + ", replicas: 4}"), "invalid_resource_name"),
    (ts("{name: gpu, replicas: 4, devices: some}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: 0}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: [a-gpu]}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: {a: 1}}"), "invalid_devices"),
    ("version: v1\nsharing:\n  timeSlicing: {}\n", "no_resources"),
    ("version: v1\nsharing:\n  timeSlicing:\n", "no_resources"),  # null: Go still unmarshals it
    (ts("{name: gpu, replicas: 4, devices: [GPU-8d1f]}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: [MIG-aa]}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: ['-1']}"), "invalid_devices"),
    (ts("{name: gpu, replicas: 4, devices: [-1]}"), "invalid_devices"),
    (ts("{name: GPU, replicas: 4}"), "invalid_resource_name"),
    (ts("{name: example.com/gpu, replicas: 4}"), "invalid_resource_name"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources: []\n", "no_resources"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources: gpu\n", "wrong_type"),
    ("version: v1\nsharing:\n  timeSlicing: [a]\n", "wrong_type"),
    ("version: v1\nsharing: on\n", "wrong_type"),
    (ts("{name: gpu, replicas: 4}", "flags: {migStrategy: all}\n"), "invalid_mig_strategy"),
    (
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: yes please\n"
        "    resources: [{name: gpu, replicas: 2}]\n",
        "wrong_type",
    ),
]


@pytest.mark.parametrize(("text", "code"), DEVICE_PLUGIN_INVALID)
def test_rejects_what_the_device_plugin_rejects(text: str, code: str) -> None:
    errors, _ = dp(text)
    assert code in errors


def test_unknown_device_plugin_keys_are_ignored_as_nvidia_does_but_warned() -> None:
    errors, warnings = dp("version: v1\nsharng: {timeSlicing: {}}\n")
    assert errors == set()
    assert warnings == {"ignored_key"}


def test_device_plugin_struct_fields_match_case_insensitively_as_go_does() -> None:
    errors, _ = dp("Version: v2\n")
    assert errors == {"unknown_version"}


def mp(text: str) -> tuple[set[str], frozenset[str]]:
    checked, names = check_mig_parted_config(yaml.safe_load(text))
    return {p.code for p in checked.errors}, names


def test_accepts_nvidia_example_mig_parted_config() -> None:
    errors, names = mp(NVIDIA_EXAMPLE_MIG_CONFIG)
    assert errors == set()
    assert "all-balanced" in names
    assert "custom-config" in names


def one(spec: str, name: str = "c") -> str:
    return f"version: v1\nmig-configs:\n  {name}:\n  - {spec}\n"


MIG_VALID = [
    one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb+me: 1, 1g.5gb: 6}}"),
    one("{devices: all, mig-enabled: true, mig-devices: {1c.2g.10gb: 2}}", "all-1g.5gb.me"),
    one("{devices: [0, 1], mig-enabled: false}"),
    one("{devices: [0], mig-enabled: false, mig-devices: {}}"),
    one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 0, 2g.10gb: 1}}"),
    one("{device-filter: '0x20B010DE', devices: all, mig-enabled: false}"),
    one("{device-filter: ['0x20B010DE', '0x20B110DE'], devices: all, mig-enabled: false}"),
    "version: v1\n",  # no mig-configs at all: mig-parted accepts it
    one("{devices: all, mig-enabled: null}"),  # Go decodes null into false
    one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 1, 2g.10gb: null}}"),
    one("{devices: [], mig-enabled: false, device-filter: [null]}"),
]


@pytest.mark.parametrize("text", MIG_VALID)
def test_accepts_what_mig_parted_accepts(text: str) -> None:
    errors, _ = mp(text)
    assert errors == set()


MIG_INVALID: list[tuple[str, str]] = [
    ("mig-configs: {}\n", "missing_key"),
    ("{}\n", "missing_key"),
    ("version: v2\nmig-configs: {}\n", "unknown_version"),
    ("version: v1\nmig-configs: {}\n", "empty_mig_configs"),
    ("version: v1\nmig-configs: []\n", "wrong_type"),
    ("version: v1\nmig-configs:\n  a: []\n", "empty_mig_config"),
    (
        "version: v1\nextra: 1\nmig-configs:\n  a: [{devices: all, mig-enabled: false}]\n",
        "unknown_key",
    ),
    (one("{devices: all}"), "missing_key"),
    (one("{mig-enabled: false}"), "missing_key"),
    (one("{devices: all, mig-enabled: true}"), "missing_key"),
    (one("{devices: all, mig-enabled: true, mig-devices: null}"), "missing_key"),
    (one("{devices: all, mig-enabled: null, mig-devices: {1g.5gb: 1}}"), "unexpected_mig_devices"),
    (one("{devices: all, mig-enabled: 'true', mig-devices: {}}"), "wrong_type"),
    (one("{devices: some, mig-enabled: false}"), "invalid_devices"),
    (one("{devices: ['0'], mig-enabled: false}"), "invalid_devices"),
    (one("{devices: 2, mig-enabled: false}"), "invalid_devices"),
    (one("{devices: all, mig-enabled: false, mig-devices: {1g.5gb: 7}}"), "unexpected_mig_devices"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 0}}"), "invalid_count"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}"), "invalid_count"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: '7'}}"), "invalid_count"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g5gb: 7}}"), "invalid_mig_profile"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5GB: 7}}"), "invalid_mig_profile"),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb+: 7}}"), "invalid_mig_profile"),
    (
        one("{devices: all, mig-enabled: true, mig-devices: {'1g.5gb+me,me': 7}}"),
        "invalid_mig_profile",
    ),
    (one("{devices: all, mig-enabled: true, mig-devices: {1g.5gb+9x: 7}}"), "invalid_mig_profile"),
    (one("{devices: all, mig-enabled: true, mig-devices: {a.b.c.d: 7}}"), "invalid_mig_profile"),
    (one("{devices: all, mig-enabled: true, mig-devices: [1g.5gb]}"), "wrong_type"),
    (one("{devices: all, mig-enabled: false, extra: 1}"), "unknown_key"),
    (one("{devices: all, mig-enabled: false, device-filter: 7}"), "wrong_type"),
    ("- version: v1\n", "wrong_type"),
]


@pytest.mark.parametrize(("text", "code"), MIG_INVALID)
def test_rejects_what_mig_parted_rejects(text: str, code: str) -> None:
    errors, _ = mp(text)
    assert code in errors


def test_every_mig_parted_problem_is_reported_at_once() -> None:
    document: Any = yaml.safe_load(
        "version: v1\nmig-configs:\n"
        "  a: [{devices: some, mig-enabled: false}]\n"
        "  b: [{devices: all, mig-enabled: true, mig-devices: {x: 1}}]\n"
    )
    checked, names = check_mig_parted_config(document, path="config.yaml")
    assert names == {"a", "b"}
    assert [p.code for p in checked.errors] == ["invalid_devices", "invalid_mig_profile"]
    assert all(p.path.startswith("config.yaml.mig-configs") for p in checked.errors)


def test_bounds_hostile_sizes() -> None:
    many = {"version": "v1", "mig-configs": {f"c{i}": [] for i in range(5000)}}
    checked, names = check_mig_parted_config(many)
    assert {p.code for p in checked.errors} == {"too_many"}
    assert names == frozenset()
    resources = [{"name": "gpu", "replicas": 2}] * 5000
    big = {"version": "v1", "sharing": {"timeSlicing": {"resources": resources}}}
    assert {p.code for p in check_device_plugin_config(big).errors} == {"too_many"}


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=8), st.sampled_from(["all", "v1"])
)
_keys = st.sampled_from(
    [
        "version",
        "mig-configs",
        "sharing",
        "timeSlicing",
        "resources",
        "name",
        "replicas",
        "devices",
        "mig-enabled",
        "mig-devices",
        "device-filter",
        "1g.5gb",
        "flags",
        "a",
    ]
)
_documents = nested_documents(_scalars, _keys)


@given(document=_documents)
def test_any_document_gives_problems_never_an_exception(document: Any) -> None:
    check_device_plugin_config(document)
    checked, names = check_mig_parted_config(document)
    assert all(p.code for p in checked.errors)
    assert all(isinstance(n, str) for n in names)
