"""gpuguard check-sharing: the JSON contract (docs/design.md, CLI outputs), exit codes, ConfigMap or
raw files, human output, and hostile input (exit 1, one line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.cli import build_parser
from rigs.cli_run import run_gpuguard

ROOT = Path(__file__).resolve().parents[1]
NVIDIA_EXAMPLE_MIG_CONFIG = (
    ROOT / "tests" / "fixtures" / "nvidia" / "mig-parted-example.yaml"
).read_text()
"""NVIDIA's mig-parted examples/config.yaml, verbatim."""
DP_LABEL = "nvidia.com/device-plugin.config"
MIG_LABEL = "nvidia.com/mig.config"

SHARING = """\
version: v1
devicePluginConfig: {namespace: gpu-operator, name: nvidia-time-slicing-config}
migConfig: {namespace: gpu-operator, name: nvidia-mig-config, key: config.yaml}
migChangePolicy: WhenIdle
rules:
  - name: t4-shared
    nodeSelector:
      matchLabels: {node.kubernetes.io/instance-type: g4dn.12xlarge}
    timeSlicing: slice-4
  - name: a100-mig
    nodeNames: [gpu-a100-1, gpu-a100-2]
    mig: all-balanced
    timeSlicing: slice-4
"""

SLICE = (
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
    "    - name: nvidia.com/gpu\n      replicas: {}\n"
)

NODES = """\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: t4-1, labels: {node.kubernetes.io/instance-type: g4dn.12xlarge}}
- {apiVersion: v1, kind: Node, metadata: {name: gpu-a100-1}}
- {apiVersion: v1, kind: Node, metadata: {name: cpu-1, labels: {kubernetes.io/os: linux}}}
"""


def config_map(name: str, data: dict[str, str]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "gpu-operator"},
            "data": data,
        }
    )


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``gpuguard check-sharing ARGS`` in a subprocess with 1 GiB of address space and 30 s."""
    return run_gpuguard("check-sharing", *args)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "sharing": tmp_path / "sharing.yaml",
        "sharing_cm": tmp_path / "sharing-cm.yaml",
        "dp_cm": tmp_path / "dp-cm.yaml",
        "mig_cm": tmp_path / "mig-cm.yaml",
        "mig_raw": tmp_path / "mig-raw.yaml",
        "nodes": tmp_path / "nodes.yaml",
    }
    paths["sharing"].write_text(SHARING)
    paths["sharing_cm"].write_text(config_map("gpuguard-sharing", {"sharing.yaml": SHARING}))
    dp = {"slice-4": SLICE.format(4), "slice-8": SLICE.format(8)}
    paths["dp_cm"].write_text(config_map("nvidia-time-slicing-config", dp))
    paths["mig_cm"].write_text(
        config_map("nvidia-mig-config", {"config.yaml": NVIDIA_EXAMPLE_MIG_CONFIG})
    )
    paths["mig_raw"].write_text(NVIDIA_EXAMPLE_MIG_CONFIG)
    paths["nodes"].write_text(NODES)
    return paths


def full(files: dict[str, Path], sharing: str = "sharing", mig: str = "mig_cm") -> list[Path | str]:
    return [
        files[sharing],
        "--device-plugin-config",
        files["dp_cm"],
        "--mig-config",
        files[mig],
        "--node",
        files["nodes"],
        "--json",
    ]


def checked(files: dict[str, Path], sharing: str, exit_code: int) -> dict[str, Any]:
    """``sharing`` written as the sharing config and checked against every file, in JSON: the
    document, once the command exited with ``exit_code``."""
    files["sharing"].write_text(sharing)
    result = cli(*full(files))
    assert result.returncode == exit_code, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


EXPECTED_NODES = [
    {
        "name": "t4-1",
        "rule": "t4-shared",
        "labels": {DP_LABEL: "slice-4", MIG_LABEL: None},
        "held": {},
    },
    {
        "name": "gpu-a100-1",
        "rule": "a100-mig",
        "labels": {DP_LABEL: "slice-4", MIG_LABEL: "all-balanced"},
        "held": {},
    },
    {"name": "cpu-1", "rule": None, "labels": {DP_LABEL: None, MIG_LABEL: None}, "held": {}},
]


def test_json_contract_for_a_valid_config(files: dict[str, Path]) -> None:
    result = cli(*full(files))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document == {
        "valid": True,
        "errors": [],
        "warnings": [],
        "nodes": EXPECTED_NODES,
        "references": {"devicePluginConfig": "file", "migConfig": "file"},
    }


@pytest.mark.parametrize(("sharing", "mig"), [("sharing_cm", "mig_cm"), ("sharing", "mig_raw")])
def test_a_config_map_and_the_raw_file_give_the_same_answer(
    files: dict[str, Path], sharing: str, mig: str
) -> None:
    result = cli(*full(files, sharing=sharing, mig=mig))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nodes"] == EXPECTED_NODES


def test_a_raw_device_plugin_file_is_one_profile_named_after_the_file(
    files: dict[str, Path], tmp_path: Path
) -> None:
    raw = tmp_path / "slice-4.yaml"
    raw.write_text(SLICE.format(4))
    result = cli(files["sharing"], "--device-plugin-config", raw, "--json")
    assert result.returncode == 0, result.stderr
    warnings = json.loads(result.stdout)["warnings"]
    assert [w.rsplit("(", 1)[1] for w in warnings] == ["profiles_not_checked)"]


def test_without_files_or_a_cluster_it_says_plainly_that_no_profile_name_was_checked(
    files: dict[str, Path],
) -> None:
    """With a missing NVIDIA ConfigMap it used to say only "valid" (and a warning per kind of
    profile)."""
    result = cli(files["sharing"], "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["references"] == {"devicePluginConfig": "not_checked", "migConfig": "not_checked"}
    assert found["warnings"][0] == (
        f"{files['sharing']}: profile names not checked: give --device-plugin-config/--mig-config "
        "or --kubeconfig (references_not_checked)"
    )
    human = cli(files["sharing"]).stdout.splitlines()[0]
    assert human.endswith(": valid (devicePluginConfig: not checked, migConfig: not checked)")


def test_cluster_nodes_without_a_kubeconfig_is_a_usage_error(files: dict[str, Path]) -> None:
    result = cli(files["sharing"], "--cluster-nodes", "--json")
    assert result.returncode == 2
    assert result.stderr == "gpuguard check-sharing: --cluster-nodes needs --kubeconfig\n"


def test_an_unknown_profile_is_invalid_with_exit_1(files: dict[str, Path]) -> None:
    document = checked(files, SHARING.replace("mig: all-balanced", "mig: all-7g.80gb"), 1)
    assert document["valid"] is False
    assert len(document["errors"]) == 1
    assert "rules[1].mig" in document["errors"][0]
    assert document["errors"][0].endswith("(unknown_profile)")


def test_an_nvidia_config_nvidia_would_reject_is_invalid(files: dict[str, Path]) -> None:
    dp = {"slice-4": SLICE.format(1)}
    files["dp_cm"].write_text(config_map("nvidia-time-slicing-config", dp))
    result = cli(*full(files))
    assert result.returncode == 1
    errors = json.loads(result.stdout)["errors"]
    assert len(errors) == 1
    assert "data['slice-4']" in errors[0]
    assert errors[0].endswith("(invalid_replicas)")


def test_warnings_alone_keep_the_config_valid(files: dict[str, Path]) -> None:
    document = checked(
        files, SHARING.replace("node.kubernetes.io/instance-type", "nvidia.com/gpu.product"), 0
    )
    assert document["valid"] is True
    assert document["warnings"][0].endswith("(selects_rewritten_label)")


FLIPPING = """\
version: v1
devicePluginConfig: {namespace: gpu-operator, name: nvidia-time-slicing-config}
migConfig: {namespace: gpu-operator, name: nvidia-mig-config, key: config.yaml}
rules:
  - name: to-slice-8
    nodeSelector:
      matchLabels: {nvidia.com/device-plugin.config: slice-4}
    timeSlicing: slice-8
  - name: to-slice-4
    nodeSelector:
      matchExpressions:
      - {key: nvidia.com/device-plugin.config, operator: NotIn, values: [slice-4]}
    timeSlicing: slice-4
  - name: after-mig
    nodeSelector:
      matchExpressions:
      - {key: nvidia.com/mig.config.state, operator: In, values: [success]}
    mig: all-balanced
"""


def test_rules_selecting_on_labels_sharing_writes_are_invalid_and_say_why(
    files: dict[str, Path],
) -> None:
    """Rules over the label they set flipped every node's label every turn (a Node write and
    an Event each; with a mig rule a re-partition each time): check-sharing called it valid."""
    document = checked(files, FLIPPING, 1)
    assert document["valid"] is False
    own = [e for e in document["errors"] if e.endswith("(selects_own_output)")]
    assert len(own) == 3, document["errors"]
    where = f"{files['sharing']}: "
    assert own[0].startswith(
        f"{where}rules[0].nodeSelector.matchLabels.nvidia.com/device-plugin.config: "
        "rule 'to-slice-8' selects on nvidia.com/device-plugin.config"
    )
    assert own[1].startswith(f"{where}rules[1].nodeSelector.matchExpressions[0]: rule 'to-slice-4'")
    assert "mig-manager" in own[2]
    # An invalid config changes nothing on any node.
    assert all(node["rule"] is None for node in document["nodes"])
    files["sharing"].write_text(FLIPPING)
    human = cli(*[a for a in full(files) if a != "--json"])
    assert human.returncode == 1
    assert "selects_own_output" in human.stdout + human.stderr
    assert "own output" in human.stdout + human.stderr


ALL_GPUS = """\
version: v1
migConfig: {namespace: gpu-operator, name: nvidia-mig-config, key: config.yaml}
migChangePolicy: Force
rules:
  - name: all-gpus
    nodeSelector: SELECTOR
    mig: all-balanced
"""

# Every YAML spelling of a selector with no requirement (Kubernetes: it selects every node).
MATCH_ALL_YAML = [
    "{}",
    "{matchLabels: null}",
    "{matchLabels: ~}",
    "{matchLabels: {}}",
    "{matchExpressions: []}",
    "{matchExpressions: null}",
    "{matchLabels: {}, matchExpressions: []}",
    "{matchLabels: null, matchExpressions: null}",
    "\n      matchLabels:\n      matchExpressions:",
]


@pytest.mark.parametrize("selector", MATCH_ALL_YAML)
def test_a_selector_that_matches_every_node_is_valid_with_a_warning_that_counts_them(
    files: dict[str, Path], selector: str
) -> None:
    files["sharing"].write_text(ALL_GPUS.replace("SELECTOR", selector))
    result = cli(
        files["sharing"], "--mig-config", files["mig_cm"], "--node", files["nodes"], "--json"
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["valid"] is True
    assert document["errors"] == []
    (warning,) = document["warnings"]
    assert warning.startswith(f"{files['sharing']}: rules[0].nodeSelector: rule 'all-gpus': ")
    assert "matches every node (3 of the 3 nodes given)" in warning
    assert (
        "migChangePolicy Force every matching node's MIG layout is changed to 'all-balanced' "
        "at once, under its running GPU pods"
    ) in warning
    assert warning.endswith("(selects_every_node)")
    assert [(n["rule"], n["labels"][MIG_LABEL]) for n in document["nodes"]] == [
        ("all-gpus", "all-balanced")
    ] * 3


def test_a_catch_all_after_other_rules_counts_only_the_nodes_it_gets(
    files: dict[str, Path],
) -> None:
    catch_all = "  - name: rest\n    nodeSelector: {}\n    timeSlicing: slice-8\n"
    document = checked(files, SHARING + catch_all, 0)
    assert document["valid"] is True
    (warning,) = document["warnings"]
    assert "rule 'rest': nodeSelector {} has no requirement" in warning
    assert "(1 of the 3 nodes given; earlier rules take the other 2)" in warning
    assert "timeSlicing 'slice-8' at once (migChangePolicy does not hold that back)" in warning
    assert "never match" not in warning
    assert document["nodes"][2]["rule"] == "rest"


def test_a_match_all_rule_first_warns_that_the_rules_after_it_never_match(
    files: dict[str, Path],
) -> None:
    first = "rules:\n  - name: everything\n    nodeSelector: {}\n    mig: all-balanced\n"
    files["sharing"].write_text(SHARING.replace("rules:\n", first))
    result = cli(*full(files)[:-1])  # human output
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stdout.splitlines() if "selects_every_node" in line)
    assert "rule 'everything': nodeSelector {} has no requirement" in warning
    assert "(3 of the 3 nodes given)" in warning
    assert "migChangePolicy WhenIdle" in warning
    assert "the rules after it never match ('t4-shared', 'a100-mig')" in warning


def test_a_match_all_warning_without_nodes_counts_nothing(files: dict[str, Path]) -> None:
    files["sharing"].write_text(ALL_GPUS.replace("SELECTOR", "{}"))
    result = cli(files["sharing"], "--mig-config", files["mig_cm"], "--json")
    assert result.returncode == 0, result.stderr
    (warning,) = json.loads(result.stdout)["warnings"]
    assert "matches every node;" in warning
    assert "nodes given" not in warning


def test_empty_node_names_are_invalid_they_select_nothing(files: dict[str, Path]) -> None:
    document = checked(files, SHARING.replace("[gpu-a100-1, gpu-a100-2]", "[]"), 1)
    assert document["valid"] is False
    assert any(
        "rules[1].nodeNames: nodeNames is empty: the rule selects nothing" in e
        for e in document["errors"]
    )


@pytest.mark.parametrize(
    ("flag", "key"), [("dp_cm", "devicePluginConfig"), ("mig_cm", "migConfig")]
)
def test_warns_when_a_config_map_is_not_the_one_the_sharing_config_names(
    files: dict[str, Path], flag: str, key: str
) -> None:
    path = files[flag]
    path.write_text(path.read_text().replace("namespace: gpu-operator", "namespace: other"))
    result = cli(*full(files))
    assert result.returncode == 0, result.stderr
    warnings = json.loads(result.stdout)["warnings"]
    assert len(warnings) == 1
    assert f"{key}.namespace" in warnings[0]
    assert warnings[0].endswith("(other_config_map)")


def test_an_invalid_sharing_config_changes_no_node_and_names_the_rule_that_selects_it(
    files: dict[str, Path],
) -> None:
    """Nothing is applied (every label null), but the table under "what the rules select"
    names each node's rule: it said "(no rule)" for nodes a rule selects."""
    document = checked(files, SHARING.replace("version: v1", "version: v9"), 1)
    assert all(v is None for n in document["nodes"] for v in n["labels"].values())
    assert {n["name"]: n["rule"] for n in document["nodes"]} == {
        "t4-1": "t4-shared",
        "gpu-a100-1": "a100-mig",
        "cpu-1": None,
    }
    assert not any("rule_unknown" in n for n in document["nodes"])
    result = cli(*full(files)[:-1])
    assert result.returncode == 1
    rows = result.stdout.splitlines()[-3:]
    assert [row.split()[:3] for row in rows] == [
        ["t4-1", "t4-shared", "(not"],
        ["gpu-a100-1", "a100-mig", "(not"],
        ["cpu-1", "(no", "rule)"],
    ]


def test_with_a_rule_that_cannot_be_read_the_nodes_after_it_are_unknown_not_no_rule(
    files: dict[str, Path],
) -> None:
    """A rule with an error may have selected the node: the rules after it cannot be said to."""
    broken = SHARING.replace(
        "  - name: a100-mig\n",
        "  - name: broken\n    nodeNames: []\n    timeSlicing: slice-4\n  - name: a100-mig\n",
    )
    document = checked(files, broken, 1)
    by_name = {n["name"]: n for n in document["nodes"]}
    assert by_name["t4-1"]["rule"] == "t4-shared"
    for name in ("gpu-a100-1", "cpu-1"):
        assert (by_name[name]["rule"], by_name[name].get("rule_unknown")) == (None, True)
    result = cli(*full(files)[:-1])
    assert "gpu-a100-1  (unknown: a rule before could not be read)" in result.stdout


def test_human_output_shows_each_node_rule_and_labels(files: dict[str, Path]) -> None:
    result = cli(*full(files)[:-1])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": valid")
    assert lines[1].split() == ["NODE", "RULE", DP_LABEL, MIG_LABEL]
    assert lines[2].split() == ["t4-1", "t4-shared", "slice-4", "(unchanged)"]
    assert lines[3].split() == ["gpu-a100-1", "a100-mig", "slice-4", "all-balanced"]
    assert lines[4].split() == ["cpu-1", "(no", "rule)", "(unchanged)", "(unchanged)"]


def test_a_file_that_cannot_be_opened_is_a_usage_error(tmp_path: Path) -> None:
    result = cli(tmp_path / "missing.yaml")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1


def test_no_file_is_a_usage_error() -> None:
    assert cli().returncode == 2


def test_help_says_what_a_null_label_means() -> None:
    result = cli("--help")
    assert result.returncode == 0
    assert "null" in result.stdout


def billion_laughs() -> str:
    lines = ["x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


HOSTILE: list[tuple[str, bytes]] = [
    ("binary", b"version: v1\n\x00\x01\x02"),
    ("not utf-8", b"version: v1\nrules: [\xff]\n"),
    ("deep", ("[" * 200 + "]" * 200).encode()),
    ("laughs", billion_laughs().encode()),
    ("huge", b"# " + b"x" * (17 * 1024 * 1024)),
    ("bad yaml", b"version: [v1\n"),
    ("two documents", b"version: v1\n---\nversion: v1\n"),
    ("a configmap without the key", config_map("gpuguard-sharing", {"other": "x"}).encode()),
    ("a configmap with hostile data", config_map("g", {"sharing.yaml": "[" * 200}).encode()),
]


@pytest.mark.parametrize(("case", "content"), HOSTILE, ids=[c for c, _ in HOSTILE])
@pytest.mark.parametrize("role", ["sharing", "--device-plugin-config", "--mig-config", "--node"])
def test_hostile_files_are_exit_1_with_one_line_and_no_traceback(
    files: dict[str, Path], tmp_path: Path, case: str, content: bytes, role: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    args: list[str | Path] = [bad] if role == "sharing" else [files["sharing"], role, bad]
    result = cli(*args)
    if role == "--device-plugin-config" and case == "a configmap with hostile data":
        # A profile that is not YAML is an error of that profile, reported with the others.
        assert result.returncode == 1
        assert "Traceback" not in result.stderr
        return
    if role == "--device-plugin-config" and case == "a configmap without the key":
        assert result.returncode == 1  # its one profile 'other' holds no config mapping
        return
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert len(result.stderr) < 400


def test_hostile_json_output_is_still_one_document(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\x00")
    result = cli(bad, "--json")
    assert result.returncode == 1
    document: dict[str, Any] = json.loads(result.stdout)
    assert document["valid"] is False
    assert document["nodes"] == []
    assert len(document["errors"]) == 1


@pytest.mark.parametrize(
    "node",
    [
        "kind: Pod\nmetadata: {name: p}\n",
        "kind: Node\nmetadata: {name: Bad_Name}\n",
        "kind: Node\nmetadata: {name: n, labels: [a]}\n",
        "kind: Node\nmetadata: {name: n, labels: {a: 1}}\n",
        "kind: Node\n",
        "kind: NodeList\nitems: 3\n",
    ],
)
def test_a_node_file_of_the_wrong_shape_is_exit_1(
    files: dict[str, Path], tmp_path: Path, node: str
) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(textwrap.dedent(node))
    result = cli(files["sharing"], "--node", path)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ("",),
        ("s.yaml", "--node="),
        ("s.yaml", "--device-plugin-config="),
        ("s.yaml", "--mig-config="),
        ("s\0.yaml",),
        ("s.yaml", "--node", "n\0.yaml"),
    ],
    ids=repr,
)
def test_an_empty_or_nul_path_is_a_usage_error(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["check-sharing", *argv])
    assert exited.value.code == 2
    assert "gpuguard check-sharing: error: argument " in capsys.readouterr().err
