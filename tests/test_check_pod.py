"""gpuguard check-pod: the JSON contract (docs/design.md, CLI outputs), exit codes and human
output."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.check_pod import ManifestError, check_pods, run_check_pod
from gpuguard.config import load_settings
from gpuguard.core.model import LimitPolicy, LimitValue
from gpuguard.core.text import display_width
from rigs.cli_run import run_gpuguard

PODS = Path(__file__).parent / "fixtures" / "pods"
ROOT = Path(__file__).resolve().parents[1]
GI = 1 << 30
KEYS = {"namespace", "name", "limit_bytes", "source", "errors", "warnings"}
NOTHING_BOUNDS = (
    "nothing would bound this pod's GPU memory on this node: no gpuguard.io/gpu-memory-limit "
    "annotation, no default (limits.default or a default for namespace {namespace}) and no "
    "declaration of a limit source in limits.sources, so gpuguard would report its memory but "
    "never stop it. Set the annotation on the pod, limits.default (the chart's value "
    "config.limits.default), or default in [limits.namespaces.{namespace}]"
)


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
        assert set(pod) >= KEYS
    return {pod["name"]: pod for pod in document["pods"]}


def test_valid_pods_resolve_with_their_source_and_exit_zero() -> None:
    code, document, err = run(PODS / "valid.yaml", gpu_memory="80Gi")
    assert code == 0
    assert document is not None
    contract = {"pods": [{k: v for k, v in pod.items() if k in KEYS} for pod in document["pods"]]}
    assert contract == {
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
                "warnings": [NOTHING_BOUNDS.format(namespace="ml")],
            },
        ]
    }
    assert "skipped 1 object that is neither a Pod nor a pod template: 1 Service" in err
    # Beyond the contract: which object, where.
    trainer = document["pods"][0]
    assert (trainer["kind"], trainer["object"]) == ("Pod", "Pod ml/trainer")
    assert (trainer["file"], trainer["where"]) == (
        str(PODS / "valid.yaml"),
        f"{PODS / 'valid.yaml'}: document 1",
    )


def test_objects_that_are_not_pods_are_summarised_once_per_kind_across_files(
    tmp_path: Path,
) -> None:
    """``helm template … | gpuguard check-pod -``: a chart's Services, ConfigMaps and RBAC are
    counted on one stderr line, not one long line each; only kindless objects are named."""
    chart = tmp_path / "chart.yaml"
    chart.write_text(
        "".join(
            f"---\napiVersion: v1\nkind: {kind}\nmetadata: {{name: o{i}}}\n"
            for i, kind in enumerate(["ConfigMap", "Service", "ConfigMap", "Role", "ConfigMap"])
        )
        + "---\nnot: kubernetes\n",
        encoding="utf-8",
    )
    more = tmp_path / "more.yaml"
    more.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n", encoding="utf-8")
    code, document, err = run(chart, more, PODS / "valid.yaml", gpu_memory="80Gi")
    assert code == 0
    assert len(by_name(document)) == 3
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "gpuguard check-pod: skipped 8 objects that are neither Pods nor pod templates: "
        f"3 ConfigMap, 3 Service, 1 Role, 1 without a kind ({chart}: document 6) (check-pod "
        "reads Pods and the pod templates of CronJob, DaemonSet, Deployment, Job, "
    )


def test_only_non_pods_is_nothing_to_check_after_the_one_summary(tmp_path: Path) -> None:
    path = tmp_path / "only.yaml"
    path.write_text("kind: ConfigMap\n---\nkind: ConfigMap\n", encoding="utf-8")
    code, document, err = run(path)
    assert code == 1
    assert document == {"pods": []}
    summary, verdict = err.splitlines()
    assert summary.startswith(
        "gpuguard check-pod: skipped 2 objects that are neither Pods nor pod templates: "
        "2 ConfigMap (check-pod reads"
    )
    assert verdict == (
        "gpuguard check-pod: no Pod or pod template found in the given files: nothing to check"
    )


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


def test_a_namespace_exempt_only_by_the_admins_label_is_said_to_be_unknowable_here(
    tmp_path: Path,
) -> None:
    """check-pod reads no cluster: a name the admin listed is exempt, a namespace that may
    carry the admin's exempt label is said to depend on it, and ``nvidia-device-plugin`` (exempt
    by name until only ``kube-system`` was) is exempt by nothing."""
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        "".join(
            f"---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {ns}-pod, namespace: {ns}}}\n"
            "spec: {containers: [{name: main, image: x}]}\n"
            for ns in ("kube-system", "nvidia-device-plugin")
        )
    )
    code, document, _ = run(manifest)
    assert code == 0
    pods = by_name(document)
    assert any("is exempt by the admin's config" in w for w in pods["kube-system-pod"]["warnings"])
    assert not any("exempt" in w for w in pods["nvidia-device-plugin-pod"]["warnings"])
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\nexempt_namespace_label = "gpuguard.io/exempt=true"\n')
    code, document, _ = run(manifest, config=config)
    pods = by_name(document)
    assert any("is exempt by the admin's config" in w for w in pods["kube-system-pod"]["warnings"])
    (warning,) = [w for w in pods["nvidia-device-plugin-pod"]["warnings"] if "exempt" in w]
    assert "gpuguard.io/exempt=true" in warning
    assert "cannot read" in warning


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


def test_a_directory_is_invalid_input_named_as_a_directory(tmp_path: Path) -> None:
    code, document, err = run(tmp_path)
    assert (code, document) == (1, {"pods": []})
    assert err.splitlines()[0] == (
        f"gpuguard check-pod: {tmp_path}: is a directory, not a regular file: refusing to read "
        "it as a manifest"
    )


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
    assert f"{manifest}: document 4: is a list, not a Kubernetes object (a mapping)" in err


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
    assert lines[0].split() == ["KIND", "NAMESPACE", "NAME", "LIMIT", "SOURCE", "STATUS"]
    assert lines[1].split()[:5] == ["Pod", "team-a", "greedy", "12Gi", "namespace-default"]
    assert lines[2].split() == ["Pod", "team-a", "fine", "4Gi", "annotation", "ok"]
    assert f"{PODS / 'invalid.yaml'}: document 1: Pod team-a/greedy:" in lines
    assert any(line.startswith("  error: invalid annotation") for line in lines)
    assert lines[-1] == "2 pod(s) checked, 1 with errors"
    assert all(line == line.rstrip() for line in lines)


def test_the_table_escapes_names_and_aligns_its_columns_by_the_cells_they_take(
    tmp_path: Path,
) -> None:
    """A name that erases the line and climbs to the row above (a fake ``ok`` row over a failed
    one) is shown escaped on its own row; columns line up after escaped and wide names alike."""
    names = ["bad\x1b[2K\x1b[1A\rPod  team-a  fake  4Gi  annotation  ok", "日本", "plain"]
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "".join(
            f"---\nkind: Pod\nmetadata:\n  name: {json.dumps(name)}\n  namespace: team-a\n"
            '  annotations: {gpuguard.io/gpu-memory-limit: "4Gi"}\n'
            for name in names
        ),
        encoding="utf-8",
    )
    out = io.StringIO()
    code = run_check_pod(
        files=[manifest], config_path=None, gpu_memory=None, as_json=False, stdout=out
    )
    assert code == 0
    text = out.getvalue()
    assert not [ch for ch in text if not ch.isprintable() and ch != "\n"], text
    lines = text.splitlines()
    assert lines[1].startswith("Pod   team-a     bad\\x1b[2K\\x1b[1A\\rPod  team-a  fake  4Gi")
    assert [line.split()[0] for line in lines[:4]] == ["KIND", "Pod", "Pod", "Pod"]
    limit_columns = {
        display_width(line[: line.rindex(word)])
        for line, word in zip(lines[:4], ["LIMIT", "4Gi", "4Gi", "4Gi"], strict=True)
    }
    assert len(limit_columns) == 1, lines[:4]


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


# ---------------------------------------------------------------------------------------------
# Hostile input: every case is exit 1 with one short line naming the file, never a traceback.


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``gpuguard check-pod ARGS`` in a subprocess with 1 GiB of address space and 30 s: an
    input that would exhaust memory or hang fails the test, not the machine."""
    return run_gpuguard("check-pod", *args, stdin=stdin)


def billion_laughs(levels: int) -> str:
    lines = ["kind: Pod", "x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    lines += [
        "metadata:",
        "  name: lol",
        f"  namespace: *a{levels - 1}",
        f"  annotations: {{gpuguard.io/gpu-memory-limit: *a{levels - 1}}}",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("levels", "size"), [(7, 600), (9, 1024)])
def test_a_billion_laughs_fails_fast_with_one_short_line(
    tmp_path: Path, levels: int, size: int
) -> None:
    manifest = tmp_path / "lol.yaml"
    manifest.write_text(billion_laughs(levels), encoding="utf-8")
    assert manifest.stat().st_size <= size
    result = cli(str(manifest), "--json")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(result.stdout) + len(result.stderr) < 1000
    assert result.stderr.startswith(
        f"gpuguard check-pod: {manifest}: document 1: aliases expand to more than"
    )


def test_ten_kilobytes_of_nested_brackets_fail_with_one_line_not_a_recursion_error(
    tmp_path: Path,
) -> None:
    manifest = tmp_path / "deep.yaml"
    manifest.write_text("kind: Pod\nspec: " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    code, document, err = run(manifest)
    assert (code, document) == (1, {"pods": []})
    (line,) = err.splitlines()[:-1]  # and "nothing to check"
    assert line.startswith(f"gpuguard check-pod: {manifest}: ")
    assert "nests deeper than 64 levels" in line or "maximum nesting depth" in line


def test_a_manifest_just_over_sixteen_mebibytes_is_refused_unread(tmp_path: Path) -> None:
    manifest = tmp_path / "big.yaml"
    head = (PODS / "valid.yaml").read_bytes()
    manifest.write_bytes(head + b"#" * (16 * 1024 * 1024 + 1 - len(head)))
    code, document, err = run(manifest)
    assert (code, document) == (1, {"pods": []})
    assert err.splitlines()[0] == (
        f"gpuguard check-pod: {manifest}: manifest is 16777217 bytes, more than the 16Mi allowed"
    )


def test_dev_zero_is_refused_as_a_device_not_read(tmp_path: Path) -> None:
    result = cli("/dev/zero")
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[0] == (
        "gpuguard check-pod: /dev/zero: is a character device, not a regular file: refusing to "
        "read it as a manifest"
    )
    assert "Traceback" not in result.stderr


def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pod.yaml"
    os.mkfifo(fifo)
    result = cli(str(fifo), "--json")
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == (
        f"gpuguard check-pod: {fifo}: is a FIFO (named pipe), not a regular file: refusing to "
        "read it as a manifest"
    )


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00", "is binary, not text (a NUL byte at byte offset 7)"),
        (
            b"kind: Pod\nmetadata: {name: \xe9t\xe9}\n",
            "is not UTF-8 text (byte 0xe9 at byte offset 27",
        ),
    ],
)
def test_binary_bytes_are_refused_with_their_offset(tmp_path: Path, data: bytes, says: str) -> None:
    manifest = tmp_path / "blob"
    manifest.write_bytes(data)
    code, _, err = run(manifest)
    assert code == 1
    assert err.splitlines()[0].startswith(f"gpuguard check-pod: {manifest}: manifest {says}")


# ---------------------------------------------------------------------------------------------
# Workloads: pod authors write Deployments and Jobs; every pod template is checked.

WORKLOADS = {
    "Deployment": "spec:\n  replicas: 2\n  template:\n{template}",
    "StatefulSet": "spec:\n  serviceName: web\n  template:\n{template}",
    "DaemonSet": "spec:\n  template:\n{template}",
    "ReplicaSet": "spec:\n  template:\n{template}",
    "ReplicationController": "spec:\n  template:\n{template}",
    "Job": "spec:\n  template:\n{template}",
    "CronJob": "spec:\n  jobTemplate:\n    spec:\n      template:\n{template}",
    "PodTemplate": "template:\n{template}",
}
TEMPLATE = """\
metadata:
  labels: {{app: web}}
  annotations:
    gpuguard.io/gpu-memory-limit: "{value}"
spec:
  containers:
    - name: train
      image: pytorch/pytorch
      resources: {{limits: {{nvidia.com/gpu: 1}}}}
"""


def workload(kind: str, value: str, *, name: str = "web") -> str:
    body = WORKLOADS[kind]
    key_line = body.split("{template}")[0].splitlines()[-1]  # "  template:"
    indent = " " * (len(key_line) - len(key_line.lstrip()) + 2)
    template = "".join(indent + line + "\n" for line in TEMPLATE.format(value=value).splitlines())
    return f"apiVersion: v1\nkind: {kind}\nmetadata:\n  name: {name}\n  namespace: team-a\n" + (
        body.format(template=template)
    )


@pytest.mark.parametrize("value", ["8GB", "0", "150%", "-1"])
@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_an_invalid_annotation_in_any_workloads_pod_template_fails_naming_the_object(
    tmp_path: Path, kind: str, value: str
) -> None:
    manifest = tmp_path / "workload.yaml"
    manifest.write_text(workload(kind, value), encoding="utf-8")
    code, document, _ = run(manifest, gpu_memory="80Gi")
    assert code == 1
    assert document is not None
    (entry,) = document["pods"]
    assert (entry["namespace"], entry["name"], entry["kind"]) == ("team-a", "web", kind)
    assert entry["object"] == f"{kind} team-a/web (pod template)"
    assert entry["file"] == str(manifest)
    assert entry["errors"][0].startswith(
        f"invalid annotation gpuguard.io/gpu-memory-limit: '{value}'"
    )


def test_valid_workload_templates_resolve_and_the_table_names_each_object(tmp_path: Path) -> None:
    manifest = tmp_path / "workloads.yaml"
    manifest.write_text(
        workload("Deployment", "8Gi")
        + "---\n"
        + workload("CronJob", "25%", name="nightly")
        + "---\napiVersion: v1\nkind: List\nitems:\n- "
        + workload("Job", "8GB", name="once").replace("\n", "\n  "),
        encoding="utf-8",
    )
    out, err = io.StringIO(), io.StringIO()
    code = run_check_pod(
        files=[manifest],
        config_path=None,
        gpu_memory="80Gi",
        as_json=False,
        stdout=out,
        stderr=err,
    )
    assert code == 1, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["KIND", "NAMESPACE", "NAME", "LIMIT", "SOURCE", "STATUS"]
    assert lines[1].split() == ["Deployment", "team-a", "web", "8Gi", "annotation", "ok"]
    assert lines[2].split() == ["CronJob", "team-a", "nightly", "20Gi", "annotation", "ok"]
    assert lines[3].split() == ["Job", "team-a", "once", "none", "-", "1", "error(s)"]
    assert f"{manifest}: document 3 item 0: Job team-a/once (pod template):" in lines
    assert lines[-1] == "3 pod(s) checked, 1 with errors"


def test_anchors_shared_between_containers_of_a_deployment_are_fine(tmp_path: Path) -> None:
    manifest = tmp_path / "anchors.yaml"
    manifest.write_text(
        "kind: Deployment\nmetadata: {name: web}\nspec:\n  template:\n    metadata:\n"
        '      annotations: {gpuguard.io/gpu-memory-limit: "4Gi"}\n    spec:\n'
        "      containers:\n"
        "        - &c {name: a, image: x, env: &e [{name: A}],\n"
        "              resources: {limits: {nvidia.com/gpu: 1}}}\n"
        "        - {<<: *c, name: b}\n"
        "        - {name: c, image: y, env: *e}\n",
        encoding="utf-8",
    )
    code, document, err = run(manifest)
    assert code == 0, err
    assert by_name(document)["web"]["limit_bytes"] == 4 * GI


def test_an_annotation_on_the_workload_instead_of_its_template_is_an_error(
    tmp_path: Path,
) -> None:
    manifest = tmp_path / "misplaced.yaml"
    manifest.write_text(
        "kind: Deployment\nmetadata:\n  name: web\n  annotations:\n"
        '    gpuguard.io/gpu-memory-limit: "8Gi"\n'
        "spec:\n  template:\n    spec:\n      containers: [{name: c, image: x}]\n",
        encoding="utf-8",
    )
    code, document, _ = run(manifest)
    assert code == 1
    (entry,) = by_name(document).values()
    assert entry["errors"] == [
        "gpuguard.io/gpu-memory-limit is on the Deployment's own metadata, which its pods do not "
        "inherit: move it to spec.template.metadata.annotations"
    ]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("kind: List\nitems: 5\n", "document 1: items is an int, not a list"),
        ("kind: Deployment\nmetadata: {name: web}\nspec: oops\n", "spec is a str, not a mapping"),
        (
            "kind: Job\nmetadata: {name: j}\nspec: {template: {metadata: {annotations: [a]}}}\n",
            "spec.template.metadata.annotations is a list, not a mapping",
        ),
        ("kind: CronJob\nmetadata: {name: c}\nspec: {}\n", "spec.jobTemplate is missing"),
    ],
)
def test_wrong_shapes_fail_naming_where_without_a_traceback(
    tmp_path: Path, content: str, says: str
) -> None:
    manifest = tmp_path / "shape.yaml"
    manifest.write_text(content, encoding="utf-8")
    code, document, err = run(manifest)
    assert code == 1
    assert document is not None
    problems = [e for pod in document["pods"] for e in pod["errors"]] + err.splitlines()
    assert any(says in problem for problem in problems), (document, err)


@pytest.mark.parametrize(
    "content", ["", "\n# only a comment\n", "---\n---\n", "kind: Service\nmetadata: {name: s}\n"]
)
def test_a_file_with_nothing_to_check_fails(tmp_path: Path, content: str) -> None:
    manifest = tmp_path / "empty.yaml"
    manifest.write_text(content, encoding="utf-8")
    code, document, err = run(manifest)
    assert (code, document) == (1, {"pods": []})
    assert err.splitlines()[-1] == (
        "gpuguard check-pod: no Pod or pod template found in the given files: nothing to check"
    )


def test_dash_reads_the_manifest_from_stdin() -> None:
    result = cli("-", "--json", "--gpu-memory", "80Gi", stdin=(PODS / "valid.yaml").read_text())
    assert result.returncode == 0, result.stderr
    pods = json.loads(result.stdout)["pods"]
    assert [p["limit_bytes"] for p in pods] == [8 * GI, 20 * GI, None]
    assert {p["file"] for p in pods} == {"<stdin>"}


# --- other schedulers' declarations ---------------------------------------------------------------


def test_with_the_config_listing_them_each_schedulers_declaration_is_the_limit_and_named(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        'version = 1\n[limits]\nsources = ["gpuguard", "kai", "hami", "gpushare", "volcano"]\n'
    )
    code, document, _err = run(PODS / "schedulers.yaml", config=config, gpu_memory="80Gi")
    pods = by_name(document)
    assert {name: (p["limit_bytes"], p["source"]) for name, p in pods.items()} == {
        "kai-memory": (2000 << 20, "kai"),
        "kai-fraction": (40 * GI, "kai"),
        "hami": ((3000 << 20) + 8 * GI, "hami"),  # 3000 MiB + 10 % of 80 GiB, summed
        "gpushare": (3 * GI, "gpushare"),
        "volcano": (4 * GI, "volcano"),
        "both": (1 * GI, "annotation"),  # the smaller: the pod's own 1Gi under KAI's 8000 MiB
        "bad-kai": (None, None),
    }
    assert any("gpu-fraction" in e and "above 1" in e for e in pods["bad-kai"]["errors"])
    assert code == 1  # bad-kai has an error


def test_without_the_config_listing_them_no_other_scheduler_is_read() -> None:
    code, document, _err = run(PODS / "schedulers.yaml", gpu_memory="80Gi")
    pods = by_name(document)
    assert {name: p["source"] for name, p in pods.items()} == {
        "kai-memory": None,
        "kai-fraction": None,
        "hami": None,
        "gpushare": None,
        "volcano": None,
        "both": "annotation",
        "bad-kai": None,
    }
    assert code == 0


# --- the most lenient source is never the tenant's pick -------------------------------------------

LENIENT_POD = """apiVersion: v1
kind: Pod
metadata:
  name: lenient
  namespace: ml
  annotations:
    gpu-fraction: "0.1"
    gpuguard.io/gpu-memory-limit: "100%"
spec:
  containers: [{name: main, image: trainer, resources: {limits: {nvidia.com/gpu: 1}}}]
"""


@pytest.mark.parametrize("sources", ['["gpuguard", "kai"]', '["kai", "gpuguard"]'])
def test_a_schedulers_declaration_caps_the_pods_own_annotation_and_check_pod_says_which_bound(
    tmp_path: Path, sources: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"version = 1\n[limits]\nsources = {sources}\n")
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(LENIENT_POD)
    code, document, err = run(manifest, config=config, gpu_memory="80Gi")
    assert (code, err) == (0, "")
    pod = by_name(document)["lenient"]
    assert (pod["limit_bytes"], pod["source"], pod["errors"]) == (8 * GI, "kai", [])
    assert any(
        w.startswith("annotation gpuguard.io/gpu-memory-limit 100% (80Gi) capped by the kai "
                     "declaration (annotation gpu-fraction) 10% (8Gi)")
        for w in pod["warnings"]
    ), pod["warnings"]  # fmt: skip
    declared = {
        d["source"]: (d["value"], d["limit_bytes"], d["bound"]) for d in pod["declarations"]
    }
    assert declared == {"annotation": ("100%", 80 * GI, False), "kai": ("10%", 8 * GI, True)}
    # The table says it too.
    out = io.StringIO()
    run_check_pod(
        files=[str(manifest)], config_path=config, gpu_memory="80Gi", as_json=False,
        stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    text = out.getvalue()
    assert "declared: kai declaration (annotation gpu-fraction) 10% = 8Gi <- binds" in text
    assert "declared: annotation gpuguard.io/gpu-memory-limit 100% = 80Gi\n" in text


def test_without_the_device_size_check_pod_says_the_smallest_declaration_is_unknown(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\nsources = ["gpuguard", "kai"]\n')
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(LENIENT_POD.replace('"100%"', '"8Gi"'))
    code, document, _err = run(manifest, config=config)
    pod = by_name(document)["lenient"]
    assert code == 1
    assert (pod["limit_bytes"], pod["source"]) == (8 * GI, "annotation"), "an upper bound"
    assert any("--gpu-memory" in e and "gpu-fraction" in e for e in pod["errors"])
    assert any("smallest declaration cannot be known" in e for e in pod["errors"])
    declared = {d["source"]: (d["limit_bytes"], d["bound"]) for d in pod["declarations"]}
    assert declared == {"annotation": (8 * GI, True), "kai": (None, False)}


def test_check_pods_declarations_carry_every_field_the_cli_contract_names(tmp_path: Path) -> None:
    """docs/design.md#cli-outputs: each declaration has ``source``, ``what``, ``value``,
    ``limit_bytes``, ``pinned``, ``assigned``, ``bound`` and ``container``, as explain's and
    inspect's do. No
    device is named here, so each applies on the GPU it names: ``assigned`` is true."""
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits]\nsources = ["gpuguard", "kai"]\n')
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(LENIENT_POD)
    code, document, err = run(manifest, config=config, gpu_memory="80Gi")
    assert (code, err) == (0, "")
    declarations = by_name(document)["lenient"]["declarations"]
    assert [sorted(d) for d in declarations] == [
        sorted(
            ["source", "what", "value", "limit_bytes", "pinned", "assigned", "bound", "container"]
        )
    ] * 2
    assert [d["assigned"] for d in declarations] == [True, True]


def test_a_pod_nothing_would_bound_is_warned_with_the_fix(tmp_path: Path) -> None:
    """A pod with no annotation, no default and no declaration a limit source reads is bounded
    by nothing on its node (``bound_by="none"``): check-pod says so before it runs, with the
    fix; a default, an annotation or an exempt namespace (already warned) does not get it."""
    manifest = tmp_path / "pods.yaml"
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
            "spec": {"containers": [{"name": "c", "image": "x", **gpu}]},
        }
        for name, namespace, annotations in (
            ("bare", "team-b", {}),
            ("annotated", "team-b", {"gpuguard.io/gpu-memory-limit": "8Gi"}),
            ("defaulted", "team-a", {}),
            ("system", "kube-system", {}),
        )
    ]
    manifest.write_text("---\n".join(json.dumps(d) + "\n" for d in docs))
    config = tmp_path / "config.toml"
    config.write_text('version = 1\n[limits.namespaces.team-a]\ndefault = "4Gi"\n')
    code, document, _ = run(manifest, config=config, gpu_memory="24Gi")
    assert code == 0
    pods = by_name(document)
    assert pods["bare"]["limit_bytes"] is None
    assert pods["bare"]["warnings"] == [NOTHING_BOUNDS.format(namespace="team-b")]
    assert not any("nothing would bound" in w for w in pods["annotated"]["warnings"])
    assert pods["defaulted"]["limit_bytes"] == 4 * GI
    assert not any("nothing would bound" in w for w in pods["defaulted"]["warnings"])
    assert not any("nothing would bound" in w for w in pods["system"]["warnings"])
    assert any("is exempt by the admin's config" in w for w in pods["system"]["warnings"])
    # With the replicas default on, a time-slicing node may still bound it: said, not hidden.
    config.write_text("version = 1\n[limits]\nreplicas_default = true\n")
    code, document, _ = run(manifest, config=config, gpu_memory="24Gi")
    (warning,) = by_name(document)["bare"]["warnings"]
    assert warning.startswith("nothing would bound this pod's GPU memory on this node")
    assert "limits.replicas_default gives it a share of the device" in warning
