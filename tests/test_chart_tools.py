"""The chart (helm/gpuguard) under the Kubernetes ecosystem's own chart checkers, each shown able
to fail: kubeconform (strict, offline: the Kubernetes v1.37 schemas of kubernetes-validate and
the prometheus-operator v0.85.0 CRDs), the helm-unittest suites of helm/gpuguard/tests/ (one per
value set of docs/design.md, Helm values) and chart-testing's ``ct lint`` (yamale, yamllint, helm
lint).

tests/test_chart.py owns ``helm lint`` and what each value renders; this module only runs the
external checkers over the chart. The tools come from ``scripts/ensure-chart-tools.sh`` (built
once from Go wrapper modules in testbin/chart-tools/, cached under ~/.cache); helm is
testbin/bin/helm, found as test_chart.py finds it. A missing tool skips locally and fails in CI
(``rigs.prereq.require``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs import controlplane
from rigs.prereq import require

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "gpuguard"
SUITES = CHART / "tests"
ALL_FEATURES = SUITES / "values" / "all-features.yaml"
CT_CONFIG = REPO / "helm" / "ct.yaml"
ENSURE = REPO / "scripts" / "ensure-chart-tools.sh"
KUBERNETES_VERSION = "1.37.0"
MONITORING_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
# Any network use fails fast: the checks must run offline (CI's runners and this machine may
# have no route out, and a schema fetched from the internet is not the one pinned here).
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}

# The value sets of docs/design.md, Helm values, each with its helm-unittest suite (the `suite:`
# name).
SUITES_BY_VALUE_SET = {
    "defaults": "default values",
    "enforcement.mode": "enforcement.mode",
    "enforcement.allocGuard": "allocation guard",
    "config": "config",
    "sharing": "sharing",
    "agent.enabled / agent.allowEviction": "agent",
    "serviceMonitor": "serviceMonitor",
    "prometheusRule": "prometheusRule",
    "dashboards": "dashboards",
    "nodeSelector / tolerations / priorityClassName": "scheduling",
    "resources": "resources",
    "image.*": "image",
    "runtimeClassName / cluster checks": "runtimeClassName and the cluster checks",
    "all of them at once": "all features",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChartTools:
    """The directory scripts/ensure-chart-tools.sh prepared, and the helm binary."""

    root: Path
    helm: Path

    @property
    def kubeconform(self) -> Path:
        return self.root / "bin" / "kubeconform"

    @property
    def helm_unittest(self) -> Path:
        return self.root / "bin" / "helm-unittest"

    @property
    def ct(self) -> Path:
        return self.root / "bin" / "ct"

    def schema_locations(self) -> list[str]:
        """kubeconform's templates: Kubernetes by version (``-strict`` picks the ``-strict``
        set), CRDs by ``{group}/{kind}_{version}``; no default (remote) location."""
        kubernetes = self.root / "schemas" / "kubernetes"
        crds = self.root / "schemas" / "crds"
        return [
            f"{kubernetes}/{{{{ .NormalizedKubernetesVersion }}}}-standalone{{{{ .StrictSuffix }}}}"
            "/{{ .ResourceKind }}{{ .KindSuffix }}.json",
            f"{crds}/{{{{ .Group }}}}/{{{{ .ResourceKind }}}}_{{{{ .ResourceAPIVersion }}}}.json",
        ]

    def env(self, home: Path) -> dict[str, str]:
        """ct's PATH: the private venv's yamllint and yamale, then helm; helm's state in
        ``home``; no network."""
        path = os.pathsep.join(
            [str(self.root / "venv" / "bin"), str(self.helm.parent), "/usr/bin", "/bin"]
        )
        return {
            "PATH": path,
            "HOME": str(home),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            **OFFLINE,
        }


@pytest.fixture(scope="session")
def chart_tools() -> ChartTools:
    """scripts/ensure-chart-tools.sh's cache (a hash when warm; minutes cold) and helm."""
    helm = controlplane.testbin_dir() / "helm"
    require(os.access(helm, os.X_OK), f"missing {helm}: run scripts/ensure-testbin.sh")
    done = subprocess.run(
        ["bash", str(ENSURE)], capture_output=True, text=True, check=False, timeout=1800
    )
    require(
        done.returncode == 0,
        f"{ENSURE.name} failed ({done.returncode}): {done.stderr[-2000:]}",
    )
    tools = ChartTools(root=Path(done.stdout.strip().splitlines()[-1]), helm=helm)
    for binary in (tools.kubeconform, tools.helm_unittest, tools.ct):
        require(os.access(binary, os.X_OK), f"{ENSURE.name} left no {binary}")
    return tools


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


def run(
    argv: Sequence[str | Path], env: dict[str, str], *, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def helm_template(tools: ChartTools, home: Path, *args: str) -> str:
    done = run(
        [tools.helm, "template", "gpuguard", CHART, "--namespace", "gpuguard", *args],
        tools.env(home),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def kubeconform(tools: ChartTools, home: Path, manifest: Path) -> tuple[int, list[dict[str, Any]]]:
    """kubeconform -strict over ``manifest``: its exit status and one result per resource."""
    argv: list[str | Path] = [
        tools.kubeconform,
        "-strict",
        "-summary",
        "-verbose",
        "-output",
        "json",
        "-kubernetes-version",
        KUBERNETES_VERSION,
    ]
    for location in tools.schema_locations():
        argv += ["-schema-location", location]
    done = run([*argv, manifest], tools.env(home))
    assert done.stdout, done.stderr
    resources: list[dict[str, Any]] = json.loads(done.stdout)["resources"]
    return done.returncode, resources


def kinds_rendered(text: str) -> list[str]:
    return sorted(d["kind"] for d in yaml.safe_load_all(text) if d)


# ---------------------------------------------------------------------------------------------
# kubeconform


@pytest.mark.parametrize(
    ("values", "crds"),
    [
        (None, False),
        (None, True),
        (ALL_FEATURES, True),
    ],
    ids=["defaults", "defaults-with-monitoring-crds", "all-features-with-monitoring-crds"],
)
def test_kubeconform_accepts_every_rendered_object_strictly_offline(
    chart_tools: ChartTools, home: Path, tmp_path: Path, values: Path | None, crds: bool
) -> None:
    args: list[str] = []
    if values is not None:
        args += ["-f", str(values)]
    for api in MONITORING_APIS if crds else ():
        args += ["--api-versions", api]
    text = helm_template(chart_tools, home, *args)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(text)
    rc, resources = kubeconform(chart_tools, home, manifest)
    assert [r for r in resources if r["status"] != "statusValid"] == []
    assert rc == 0
    # Every object was validated against a schema: none skipped, none missed.
    assert sorted(r["kind"] for r in resources) == kinds_rendered(text)
    kinds = set(kinds_rendered(text))
    assert ({"ServiceMonitor", "PrometheusRule"} <= kinds) == crds
    if values is not None:
        assert {"ClusterRole", "ValidatingAdmissionPolicy", "DaemonSet"} <= kinds


_DAEMONSET = """\
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: broken}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers:
        - name: c
          image: i
"""


@pytest.mark.parametrize(
    ("manifest", "complaint"),
    [
        (
            _DAEMONSET + "          securityContext: {capabilites: {add: [KILL]}}\n",
            "additional properties 'capabilites' not allowed",
        ),
        (_DAEMONSET + "          ports: [{containerPort: '9410'}]\n", "want integer"),
        (
            "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: m}\n"
            "spec:\n  selector: {}\n  endpoints: [{port: metrics, honourLabels: true}]\n",
            "additional properties 'honourLabels' not allowed",
        ),
        (
            "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata: {name: r}\n"
            "spec:\n  groups: [{name: g, rules: [{alert: A, expr: up, for: 5 minutes}]}]\n",
            "does not match pattern",
        ),
        (
            "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n",
            "could not find schema for Widget",
        ),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a, name: b}\n", "already set"),
    ],
    ids=[
        "misspelt-field",
        "wrong-type",
        "crd-unknown-field",
        "crd-pattern",
        "no-schema-is-an-error",
        "duplicate-key",
    ],
)
def test_kubeconform_rejects_a_broken_object(
    chart_tools: ChartTools, home: Path, tmp_path: Path, manifest: str, complaint: str
) -> None:
    """The check above can fail: a misspelt or mistyped field, in a built-in kind or a
    Prometheus Operator one, an unknown kind and a duplicated key are each refused."""
    path = tmp_path / "broken.yaml"
    path.write_text(manifest)
    rc, resources = kubeconform(chart_tools, home, path)
    assert rc != 0
    (result,) = resources
    assert result["status"] in ("statusInvalid", "statusError")
    assert complaint in result["msg"]


# ---------------------------------------------------------------------------------------------
# helm-unittest


def helm_unittest(
    tools: ChartTools, home: Path, chart: Path, report: Path
) -> tuple[subprocess.CompletedProcess[str], ElementTree.Element]:
    done = run(
        [tools.helm_unittest, "--strict", "-t", "JUnit", "-o", report, chart], tools.env(home)
    )
    assert report.exists(), done.stdout + done.stderr
    return done, ElementTree.parse(report).getroot()


def test_helm_unittest_suites_cover_each_value_set_and_pass(
    chart_tools: ChartTools, home: Path, tmp_path: Path
) -> None:
    done, report = helm_unittest(chart_tools, home, CHART, tmp_path / "junit.xml")
    assert done.returncode == 0, done.stdout + done.stderr
    suites = {s.get("name"): s for s in report.iter("testsuite")}
    missing = {k: v for k, v in SUITES_BY_VALUE_SET.items() if v not in suites}
    assert not missing, f"no helm-unittest suite for {missing}"
    for name, suite in suites.items():
        assert int(suite.get("tests", "0")) > 0, name
        assert suite.get("failures") == "0", name
        assert suite.get("errors", "0") == "0", name
        assert suite.get("skipped", "0") == "0", name
    assert len(suites) == len(list(SUITES.glob("*_test.yaml")))


def test_helm_unittest_fails_on_a_failing_suite(
    chart_tools: ChartTools, home: Path, tmp_path: Path
) -> None:
    """The run above can fail: a suite whose assertion the chart does not meet fails it."""
    chart = tmp_path / "gpuguard"
    shutil.copytree(CHART, chart)
    (chart / "tests" / "zz_wrong_test.yaml").write_text(
        "suite: wrong on purpose\ntemplates: [agent-daemonset.yaml]\ntests:\n"
        "  - it: expects the agent to be privileged\n    asserts:\n"
        "      - equal:\n"
        '          path: spec.template.spec.containers[?(@.name == "agent")]'
        ".securityContext.privileged\n"
        "          value: true\n"
    )
    done, report = helm_unittest(chart_tools, home, chart, tmp_path / "junit.xml")
    assert done.returncode != 0
    failed = {s.get("name") for s in report.iter("testsuite") if s.get("failures") != "0"}
    assert failed == {"wrong on purpose"}


# ---------------------------------------------------------------------------------------------
# ct lint


def ct_lint(
    tools: ChartTools, home: Path, *, cwd: Path = REPO, chart: str = "helm/gpuguard"
) -> subprocess.CompletedProcess[str]:
    """``ct lint`` with helm/ct.yaml and ct's own Chart.yaml schema and yamllint config."""
    etc = tools.root / "ct" / "etc"
    return run(
        [
            tools.ct,
            "lint",
            "--config",
            CT_CONFIG,
            "--charts",
            chart,
            "--lint-conf",
            etc / "lintconf.yaml",
            "--chart-yaml-schema",
            etc / "chart_schema.yaml",
            "--debug",
        ],
        tools.env(home),
        cwd=cwd,
    )


def test_ct_lint_passes(chart_tools: ChartTools, home: Path) -> None:
    done = ct_lint(chart_tools, home)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "All charts linted successfully" in output
    # Each of ct's checks ran (--debug prints the commands), with the private venv's tools.
    venv = chart_tools.root / "venv" / "bin"
    assert ">>> yamale --schema" in output
    assert ">>> yamllint --config-file" in output
    assert "helm/gpuguard/values.yaml" in output
    assert ">>> helm lint" in output
    assert (venv / "yamale").exists()
    assert (venv / "yamllint").exists()


@pytest.mark.parametrize(
    ("file", "addition", "complaint"),
    [
        ("Chart.yaml", "bogus: 1\n", "bogus: Unexpected element"),
        ("values.yaml", "agent:\n  enabled: true\n", 'duplication of key "agent"'),
    ],
    ids=["chart-yaml-unknown-key", "values-duplicate-key"],
)
def test_ct_lint_fails_on_a_broken_chart(
    chart_tools: ChartTools, home: Path, tmp_path: Path, file: str, addition: str, complaint: str
) -> None:
    """ct lint can fail: yamale refuses an unknown Chart.yaml key, yamllint a duplicate key."""
    chart = tmp_path / "helm" / "gpuguard"
    shutil.copytree(CHART, chart)
    with (chart / file).open("a") as f:
        f.write(addition)
    done = ct_lint(chart_tools, home, cwd=tmp_path)
    assert done.returncode != 0
    assert complaint in done.stdout + done.stderr
