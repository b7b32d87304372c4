"""gpuguard check-pod: what it tells an admin who would otherwise read "ok" and be wrong (a
scheduler's declaration ``limits.sources`` does not read, a limit the namespace maximum set, a
percentage it cannot size, a namespace kept in audit) and what it prints when nothing was
checked."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.check_pod import run_check_pod
from rigs.cli_run import run_gpuguard

PODS = Path(__file__).parent / "fixtures" / "pods"
GI = 1 << 30


def check(
    *files: str | Path,
    config: str | Path | None = None,
    gpu_memory: str | None = None,
    as_json: bool = True,
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check_pod(
        files=list(files),
        config_path=config,
        gpu_memory=gpu_memory,
        as_json=as_json,
        stdout=out,
        stderr=err,
    )
    return code, out.getvalue(), err.getvalue()


def pods(out: str) -> dict[str, dict[str, Any]]:
    return {pod["name"]: pod for pod in json.loads(out)["pods"]}


def pod_yaml(name: str, namespace: str, annotations: dict[str, str], resources: str = "") -> str:
    limits = f", resources: {{limits: {{{resources}}}}}" if resources else ""
    return (
        f"---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, "
        f"annotations: {json.dumps(annotations)}}}\n"
        f"spec: {{containers: [{{name: main, image: x{limits}}}]}}\n"
    )


@pytest.mark.parametrize(
    ("name", "source", "where"),
    [
        ("kai-memory", "kai", "annotation gpu-memory"),
        ("kai-fraction", "kai", "annotation gpu-fraction"),
        ("hami", "hami", "nvidia.com/gpumem"),
        ("gpushare", "gpushare", "aliyun.com/gpu-mem"),
        ("volcano", "volcano", "volcano.sh/vgpu-memory"),
    ],
)
def test_a_declaration_limits_sources_does_not_list_is_warned_even_under_a_default(
    tmp_path: Path, name: str, source: str, where: str
) -> None:
    """With a cluster default the pod is bounded, so nothing else would warn: its scheduler's
    declaration is silently not what gpuguard enforces unless check-pod says so."""
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\ndefault = "20Gi"\n')
    code, out, _ = check(PODS / "schedulers.yaml", config=config, gpu_memory="80Gi")
    assert code == 0
    pod = pods(out)[name]
    assert (pod["limit_bytes"], pod["source"]) == (20 * GI, "default")
    (warning,) = [w for w in pod["warnings"] if "limits.sources does not list" in w]
    assert warning.startswith(f"limits.sources does not list {source}: gpuguard would not ")
    assert where in warning
    assert f'add "{source}" to limits.sources' in warning
    # Listed, the declaration binds and no such warning is given.
    config.write_text(f'version = 1\n[limits]\nsources = ["gpuguard", "{source}"]\n')
    _, out, _ = check(PODS / "schedulers.yaml", config=config, gpu_memory="80Gi")
    listed = pods(out)[name]
    assert listed["source"] == source
    assert not any("limits.sources does not list" in w for w in listed["warnings"])


def test_the_annotation_is_warned_when_limits_sources_leaves_gpuguard_out(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\nsources = ["kai"]\n')
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        pod_yaml("p", "ml", {"gpuguard.io/gpu-memory-limit": "8Gi"}, "nvidia.com/gpu: 1")
    )
    code, out, _ = check(manifest, config=config)
    pod = pods(out)["p"]
    assert (code, pod["limit_bytes"]) == (0, None)
    assert any(
        w.startswith("limits.sources does not list gpuguard: gpuguard would not enforce the "
                     "annotation gpuguard.io/gpu-memory-limit")
        for w in pod["warnings"]
    ), pod["warnings"]  # fmt: skip


def test_a_pod_a_scheduler_gives_a_gpu_without_an_nvidia_request_is_not_told_its_limit_is_void(
    tmp_path: Path,
) -> None:
    """KAI's fraction pods and gpushare's pods get their GPU without any ``nvidia.com/*``
    request; a pod that asks for no GPU at all still hears that its limit has no effect."""
    limit = {"gpuguard.io/gpu-memory-limit": "8Gi"}
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        pod_yaml("kai", "ml", {**limit, "gpu-fraction": "0.5"})
        + pod_yaml("gpushare", "ml", limit, "aliyun.com/gpu-mem: 3")
        + pod_yaml("volcano", "ml", limit, "volcano.sh/vgpu-number: 1")
        + pod_yaml("cpu", "ml", limit)
    )
    code, out, _ = check(manifest)
    assert code == 0
    found = pods(out)
    void = {name for name, pod in found.items() if any("no effect" in w for w in pod["warnings"])}
    assert void == {"cpu"}


def test_a_limit_the_namespace_maximum_set_is_shown_as_the_maximums(tmp_path: Path) -> None:
    """The annotation asked for 30Gi; the namespace maximum holds it to 16Gi: that is what
    bounds the pod (``bound_by`` as in gpuguard_gpu_memory_bound_bytes), and the table says so."""
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits.namespaces.team-a]\nmax = "16Gi"\n')
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        pod_yaml("capped", "team-a", {"gpuguard.io/gpu-memory-limit": "30Gi"}, "nvidia.com/gpu: 1")
        + pod_yaml("under", "team-a", {"gpuguard.io/gpu-memory-limit": "8Gi"}, "nvidia.com/gpu: 1")
    )
    code, out, _ = check(manifest, config=config)
    found = pods(out)
    assert code == 0
    assert (found["capped"]["limit_bytes"], found["capped"]["bound_by"]) == (
        16 * GI,
        "namespace_max",
    )
    assert found["capped"]["source"] == "annotation"  # the contract's field, unchanged
    assert found["under"]["bound_by"] == "annotation"
    _, table, _ = check(manifest, config=config, as_json=False)
    rows = {line.split()[2]: line.split() for line in table.splitlines()[1:3]}
    assert rows["capped"][3:5] == ["16Gi", "namespace-max"]
    assert rows["under"][3:5] == ["8Gi", "annotation"]


def test_a_percentage_without_the_device_size_is_shown_as_written_not_as_none(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\ndefault = "10%"\n')
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        pod_yaml("quarter", "ml", {"gpuguard.io/gpu-memory-limit": "25%"}, "nvidia.com/gpu: 1")
        + pod_yaml("defaulted", "ml", {}, "nvidia.com/gpu: 1")
        + pod_yaml("sized", "ml", {"gpuguard.io/gpu-memory-limit": "8Gi"}, "nvidia.com/gpu: 1")
    )
    code, out, _ = check(manifest, config=config)
    assert code == 1  # still an error: it needs --gpu-memory
    found = pods(out)
    assert {name: (p["limit_bytes"], p["unresolved_limit"]) for name, p in found.items()} == {
        "quarter": (None, "25%"),
        "defaulted": (None, "10%"),
        "sized": (8 * GI, None),
    }
    _, table, _ = check(manifest, config=config, as_json=False)
    lines = table.splitlines()
    assert lines[1].split()[3:7] == ["25%", "(size", "unknown)", "annotation"]
    assert lines[2].split()[3:7] == ["10%", "(size", "unknown)", "default"]
    _, out, _ = check(manifest, config=config, gpu_memory="80Gi")
    assert pods(out)["quarter"]["unresolved_limit"] is None


def test_a_namespace_the_admin_keeps_in_audit_mode_is_noted(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        'version = 1\n[limits.namespaces.onboarding]\nmode = "audit"\n'
        '[limits.namespaces.prod]\nmode = "enforce"\n'
    )
    limit = {"gpuguard.io/gpu-memory-limit": "8Gi"}
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        pod_yaml("new", "onboarding", limit, "nvidia.com/gpu: 1")
        + pod_yaml("old", "prod", limit, "nvidia.com/gpu: 1")
    )
    code, out, _ = check(manifest, config=config)
    found = pods(out)
    assert code == 0
    assert found["new"]["warnings"] == [
        'namespace onboarding is in audit mode ([limits.namespaces.onboarding] mode = "audit"): '
        "gpuguard logs what it would stop in this pod but never stops it"
    ]
    assert found["old"]["warnings"] == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("", "no Pod or pod template found"),
        ("kind: Pod\nmetadata: {name: [\n", "not valid YAML"),
    ],
    ids=["empty", "invalid-yaml"],
)
def test_a_file_with_nothing_checked_prints_no_table_only_the_reason(
    tmp_path: Path, content: str, says: str
) -> None:
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(content)
    code, out, err = check(manifest, as_json=False)
    assert (code, out) == (1, "")
    assert says in err
    # JSON keeps its one document.
    code, out, _ = check(manifest)
    assert (code, json.loads(out)) == (1, {"pods": []})


def test_help_names_the_config_argument_a_file_like_the_others() -> None:
    result = run_gpuguard("check-pod", "--help")
    assert result.returncode == 0, result.stderr
    assert "[--config FILE]" in result.stdout
    assert "CONFIG" not in result.stdout
