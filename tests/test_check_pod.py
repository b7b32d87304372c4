"""gpuguard check-pod: the DESIGN §5.2 JSON contract, exit codes and human output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.check_pod import ManifestError, check_pods, run_check_pod
from gpuguard.config import load_settings
from gpuguard.core.model import LimitPolicy, LimitValue

PODS = Path(__file__).parent / "fixtures" / "pods"
ROOT = Path(__file__).resolve().parents[1]
GI = 1 << 30
KEYS = {"namespace", "name", "limit_bytes", "source", "errors", "warnings"}


def run(
    *files: str | Path, config: str | Path | None = None, gpu_memory: str | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check_pod(
        files=list(files),
        config_path=config,
        gpu_memory=gpu_memory,
        as_json=True,
        stdout=out,
        stderr=err,
    )
    return code, (json.loads(out.getvalue()) if out.getvalue() else None), err.getvalue()


def by_name(document: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    assert document is not None
    assert set(document) == {"pods"}
    for pod in document["pods"]:
        assert set(pod) == KEYS
    return {pod["name"]: pod for pod in document["pods"]}


def test_valid_pods_resolve_with_their_source_and_exit_zero() -> None:
    code, document, err = run(PODS / "valid.yaml", gpu_memory="80Gi")
    assert code == 0
    assert document == {
        "pods": [
            {
                "namespace": "ml",
                "name": "trainer",
                "limit_bytes": 8 * GI,
                "source": "annotation",
                "errors": [],
                "warnings": [],
            },
            {
                "namespace": "default",
                "name": "notebook",
                "limit_bytes": 20 * GI,
                "source": "annotation",
                "errors": [],
                "warnings": [],
            },
            {
                "namespace": "ml",
                "name": "plain",
                "limit_bytes": None,
                "source": None,
                "errors": [],
                "warnings": [],
            },
        ]
    }
    assert "document 4 is a Service, not a Pod: skipped" in err


def test_a_percentage_without_gpu_memory_is_an_error_and_exits_one() -> None:
    code, document, _ = run(PODS / "valid.yaml")
    assert code == 1
    notebook = by_name(document)["notebook"]
    assert notebook["limit_bytes"] is None
    assert notebook["source"] == "annotation"
    assert "--gpu-memory" in notebook["errors"][0]
    assert by_name(document)["trainer"]["errors"] == []


def test_an_invalid_annotation_is_an_error_and_the_namespace_default_applies() -> None:
    code, document, _ = run(PODS / "invalid.yaml", config=PODS / "config.toml")
    assert code == 1
    pods = by_name(document)
    greedy = pods["greedy"]
    assert (greedy["limit_bytes"], greedy["source"]) == (12 * GI, "namespace-default")
    assert greedy["errors"][0].startswith("invalid annotation gpuguard.io/gpu-memory-limit: '8GB'")
    assert "did you mean 8Gi or 8G?" in greedy["errors"][0]
    assert (pods["fine"]["limit_bytes"], pods["fine"]["errors"]) == (4 * GI, [])


def test_without_config_an_invalid_annotation_means_no_limit_never_zero() -> None:
    code, document, _ = run(PODS / "invalid.yaml")
    assert code == 1
    greedy = by_name(document)["greedy"]
    assert (greedy["limit_bytes"], greedy["source"]) == (None, None)


def test_an_annotation_above_the_namespace_maximum_is_capped_and_self_exemption_ignored() -> None:
    code, document, _ = run(PODS / "capped.yaml", config=PODS / "config.toml")
    assert code == 0
    pod = by_name(document)["wants-more"]
    assert (pod["limit_bytes"], pod["source"]) == (16 * GI, "annotation")
    assert any("capped to the maximum of namespace team-a" in w for w in pod["warnings"])
    assert any(
        w.startswith("unknown annotation gpuguard.io/exempt ignored") for w in pod["warnings"]
    )


def test_a_limit_above_the_device_is_null_with_a_warning() -> None:
    code, document, _ = run(PODS / "capped.yaml", gpu_memory="24Gi")
    assert code == 0
    pod = by_name(document)["wants-more"]
    assert (pod["limit_bytes"], pod["source"]) == (None, "annotation")
    assert any("effectively unlimited" in w for w in pod["warnings"])


def test_reads_list_items_and_flags_unquoted_numbers_and_exempt_namespaces() -> None:
    code, document, _ = run(PODS / "pod-list.yaml")
    assert code == 1
    pods = by_name(document)
    assert pods["a"]["namespace"] == "kube-system"
    assert "is exempt by the admin's config" in pods["a"]["warnings"][0]
    assert "is not a string" in pods["b"]["errors"][0]


def test_invalid_yaml_names_file_and_line_exits_one_and_other_files_still_report() -> None:
    code, document, err = run(PODS / "broken.yaml", PODS / "valid.yaml", gpu_memory="80Gi")
    assert code == 1
    assert f"{PODS / 'broken.yaml'}: not valid YAML at line 8" in err
    assert set(by_name(document)) == {"trainer", "notebook", "plain"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"files": ["/nonexistent/pod.yaml"]}, "/nonexistent/pod.yaml: cannot read"),
        (
            {"files": [PODS / "valid.yaml"], "gpu_memory": "80GB"},
            "--gpu-memory: '80GB' has an unknown unit",
        ),
        (
            {"files": [PODS / "valid.yaml"], "gpu_memory": "50%"},
            "--gpu-memory: '50%' is a percentage",
        ),
        (
            {
                "files": [PODS / "valid.yaml"],
                "config": ROOT / "tests/fixtures/config/version-2.toml",
            },
            "--config: invalid configuration",
        ),
    ],
)
def test_usage_errors_exit_two_with_nothing_on_stdout(args: dict[str, Any], says: str) -> None:
    code, document, err = run(
        *args["files"], config=args.get("config"), gpu_memory=args.get("gpu_memory")
    )
    assert code == 2
    assert document is None
    assert says in err


def test_a_directory_is_unreadable_and_a_usage_error(tmp_path: Path) -> None:
    code, document, err = run(tmp_path)
    assert (code, document) == (2, None)
    assert "cannot read" in err


def test_pods_without_name_or_namespace(tmp_path: Path) -> None:
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        "kind: Pod\nmetadata: {generateName: job-}\n---\nkind: Pod\nmetadata: {}\n---\n"
        "kind: Pod\n---\n- not\n- an object\n",
        encoding="utf-8",
    )
    code, document, err = run(manifest)
    assert code == 1
    assert document is not None
    first, second, third = document["pods"]
    assert (first["name"], first["namespace"], first["errors"]) == ("job-", "default", [])
    assert second["errors"] == ["metadata.name is missing"]
    assert third["errors"] == ["metadata is missing or not a mapping", "metadata.name is missing"]
    assert "document 4 is not a Kubernetes object" in err


def test_an_annotated_pod_that_requests_no_gpu_is_warned(tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "kind: Pod\nmetadata:\n  name: cpu\n  annotations:\n"
        '    gpuguard.io/gpu-memory-limit: "1Gi"\nspec:\n  containers: [{name: c, image: x}]\n',
        encoding="utf-8",
    )
    code, document, _ = run(manifest)
    assert code == 0
    assert "the limit has no effect" in by_name(document)["cpu"]["warnings"][0]


def test_check_pods_takes_settings_or_a_policy() -> None:
    settings = load_settings(config_path=PODS / "config.toml", environ={})
    from_settings = check_pods(
        [PODS / "invalid.yaml"], settings_or_policy=settings, gpu_memory_bytes=None
    )
    assert by_name(from_settings)["greedy"]["limit_bytes"] == 12 * GI
    policy = LimitPolicy(cluster_default=LimitValue(percent=50))
    from_policy = check_pods(
        [PODS / "invalid.yaml"], settings_or_policy=policy, gpu_memory_bytes=24 * GI
    )
    assert by_name(from_policy)["greedy"]["limit_bytes"] == 12 * GI
    with pytest.raises(ManifestError) as caught:
        check_pods([PODS / "broken.yaml"], settings_or_policy=policy, gpu_memory_bytes=None)
    assert caught.value.exit_code == 1


def test_human_output_is_a_table_with_problems_listed_below() -> None:
    out = io.StringIO()
    code = run_check_pod(
        files=[PODS / "invalid.yaml"],
        config_path=PODS / "config.toml",
        gpu_memory=None,
        as_json=False,
        stdout=out,
        stderr=io.StringIO(),
    )
    assert code == 1
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "LIMIT", "SOURCE", "STATUS"]
    assert lines[1].split()[:4] == ["team-a", "greedy", "12Gi", "namespace-default"]
    assert lines[2].split() == ["team-a", "fine", "4Gi", "annotation", "ok"]
    assert "team-a/greedy:" in lines
    assert any(line.startswith("  error: invalid annotation") for line in lines)
    assert lines[-1] == "2 pod(s) checked, 1 with errors"
    assert all(line == line.rstrip() for line in lines)


def test_the_cli_prints_one_json_document_and_exits_per_the_contract() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuguard.cli",
            "check-pod",
            str(PODS / "valid.yaml"),
            "--gpu-memory",
            "80Gi",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert [p["limit_bytes"] for p in json.loads(result.stdout)["pods"]] == [8 * GI, 20 * GI, None]
