"""The shipped alert rules (``helm/gpuguard/files/alerts.yaml``) on a real Prometheus 3.16:
``promtool check rules`` and the ``promtool test rules`` unit tests in ``tests/alerts/``, plus
what promtool cannot see: every alert has a firing and a quiet case that assert its labels and
annotations, a severity and a runbook section in ``docs/alerts.md``, and uses only the metrics
and labels gpuguard really exports (read from a scrape of the real recorders).

promtool comes from ``scripts/ensure-prometheus.sh`` (built once from the Go module, cached);
``$PROMETHEUS_DIR`` points at another directory holding ``promtool``. A missing promtool skips
locally and fails in CI (``rigs.prereq.require``).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigs.controlplane import free_port
from tests.exported_metrics import TARGET_LABELS, exported
from tests.helpers.demo_prometheus import demo_under_prometheus
from tests.promtools import get_json, tool

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "helm" / "gpuguard" / "files" / "alerts.yaml"
UNIT_TESTS = sorted((REPO / "tests" / "alerts").glob("*.test.yaml"))
RUNBOOK = REPO / "docs" / "alerts.md"
PROMETHEUS_VERSION = "3.16.0"

SEVERITIES = frozenset({"critical", "warning", "info"})


@pytest.fixture
def promtool() -> Path:
    return tool("promtool")


@pytest.fixture
def prometheus() -> Path:
    return tool("prometheus")


def run(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), *args], capture_output=True, text=True, check=False, cwd=REPO, timeout=300
    )


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alerting_rules() -> Iterator[dict[str, Any]]:
    for group in load(RULES)["groups"]:
        for rule in group["rules"]:
            assert "alert" in rule, f"{rule!r}: recording rules belong elsewhere"
            yield rule


ALERTS = [rule["alert"] for rule in alerting_rules()]


def cases_of(alert: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(test name, alert_rule_test entry)`` for every check of ``alert`` in the unit tests."""
    for path in UNIT_TESTS:
        for test in load(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                if case["alertname"] == alert:
                    yield f"{path.name}: {test['name']}", case


# --- promtool on Prometheus 3.16 --------------------------------------------------------------


def test_promtool_is_prometheus_3_16(promtool: Path) -> None:
    # Prometheus 3 reads a range as left-open: rules that pass on 2.x can yield nothing on 3.x.
    done = run(promtool, "--version")
    assert f"version {PROMETHEUS_VERSION} " in done.stdout, done.stdout + done.stderr


def test_the_rules_file_passes_promtool_check_rules_with_every_lint(promtool: Path) -> None:
    done = run(promtool, "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout, done.stdout


def test_promtool_check_rules_rejects_a_broken_rule(promtool: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        RULES.read_text().replace(
            "time() - gpuguard_pod_last_kill_timestamp_seconds < 300",
            "time() - gpuguard_pod_last_kill_timestamp_seconds < (300",
        )
    )
    assert broken.read_text() != RULES.read_text(), "the rule to break is gone: update this test"
    done = run(promtool, "check", "rules", str(broken))
    assert done.returncode != 0, done.stdout


@pytest.mark.parametrize("unit_test", UNIT_TESTS, ids=lambda p: p.name)
def test_the_promtool_unit_tests_pass(promtool: Path, unit_test: Path) -> None:
    done = run(promtool, "test", "rules", str(unit_test.relative_to(REPO)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout, done.stdout


def test_a_unit_test_expecting_the_wrong_pod_fails(promtool: Path, tmp_path: Path) -> None:
    # The unit tests are not vacuous: the same file with another pod expected fails.
    source = REPO / "tests" / "alerts" / "enforcement.test.yaml"
    wrong = tmp_path / "wrong.test.yaml"
    text = source.read_text().replace("              pod: train-0\n", "              pod: eval-0\n")
    assert text != source.read_text()
    wrong.write_text(text.replace("../../helm/", f"{REPO}/helm/"))
    done = run(promtool, "test", "rules", str(wrong))
    assert done.returncode != 0, done.stdout
    assert "GPUGuardContainerKilled" in done.stdout + done.stderr


# --- what promtool cannot see ------------------------------------------------------------------


def test_unit_test_files_cover_only_the_shipped_rules_file() -> None:
    assert UNIT_TESTS, "no tests/alerts/*.test.yaml"
    for path in UNIT_TESTS:
        doc = load(path)
        assert [(path.parent / f).resolve() for f in doc["rule_files"]] == [RULES], path.name


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_has_a_firing_and_a_quiet_case_asserting_labels_and_annotations(
    alert: str,
) -> None:
    cases = list(cases_of(alert))
    firing = [(name, c) for name, c in cases if c.get("exp_alerts")]
    quiet = [(name, c) for name, c in cases if not c.get("exp_alerts")]
    assert firing, f"{alert}: no test case where it fires"
    assert quiet, f"{alert}: no test case where it stays quiet"
    rule = next(r for r in alerting_rules() if r["alert"] == alert)
    for name, case in firing:
        for expected in case["exp_alerts"]:
            labels, annotations = expected.get("exp_labels", {}), expected.get("exp_annotations")
            assert labels.get("severity") == rule["labels"]["severity"], name
            assert annotations is not None, f"{name}: annotations not asserted"
            assert set(annotations) == set(rule["annotations"]), name


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_has_a_severity_summary_description_and_runbook_section(alert: str) -> None:
    rule = next(r for r in alerting_rules() if r["alert"] == alert)
    assert rule["labels"]["severity"] in SEVERITIES
    assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
    anchor = alert.lower()
    assert rule["annotations"]["runbook_url"] == f"docs/alerts.md#{anchor}"
    headings = re.findall(r"^#{2,4} (\S+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    assert alert in headings, f"docs/alerts.md has no section '{alert}' (anchor #{anchor})"


def test_alert_names_are_unique_and_prefixed() -> None:
    assert len(ALERTS) == len(set(ALERTS))
    assert all(re.fullmatch(r"GPUGuard[A-Z][A-Za-z]+", a) for a in ALERTS), ALERTS


def test_the_kill_counter_has_no_pod_labels_and_the_kill_series_has_all_of_them() -> None:
    # Why GPUGuardContainerKilled reads gpuguard_pod_last_kill_timestamp_seconds (alerts.yaml):
    # the counter has no pod label (docs/design.md, Metrics); the kill series carries the per-pod
    # labels.
    assert exported()["gpuguard_kills_total"] == frozenset()
    assert (
        exported()["gpuguard_pod_last_kill_timestamp_seconds"]
        == (exported()["gpuguard_pod_gpu_memory_used_bytes"])
    )
    assert exported()["gpuguard_pod_gpu_memory_used_bytes"] >= {"namespace", "pod", "UUID"}


def test_the_rules_use_only_metrics_gpuguard_exports() -> None:
    exprs = " ".join(rule["expr"] for rule in alerting_rules())
    used = set(re.findall(r"\bgpuguard_[a-z_]+\b", exprs))
    assert used, exprs
    missing = used - set(exported())
    assert not missing, f"not exported by gpuguard: {sorted(missing)}"


def test_the_rules_group_and_match_only_on_labels_gpuguard_or_the_scrape_gives() -> None:
    known = frozenset().union(*exported().values()) | TARGET_LABELS
    for rule in alerting_rules():
        clauses = re.findall(
            r"\b(?:by|on|without|group_left|group_right)\s*\(([^)]*)\)", rule["expr"]
        )
        used = {label.strip() for clause in clauses for label in clause.split(",") if label.strip()}
        assert used <= known, f"{rule['alert']}: {sorted(used - known)}"


def test_the_unit_tests_give_gpuguard_series_only_labels_it_exports() -> None:
    series = re.compile(r"^(\w+)\{(.*)\}$")
    for path in UNIT_TESTS:
        for test in load(path)["tests"]:
            for item in test.get("input_series", []):
                match = series.match(item["series"])
                assert match, item["series"]
                name, body = match.groups()
                if not name.startswith("gpuguard_"):
                    continue
                labels = set(re.findall(r'(\w+)="', body))
                assert name in exported(), f"{path.name}: {name} is not exported"
                invented = labels - exported()[name] - TARGET_LABELS
                assert not invented, f"{path.name}: {name} has no labels {sorted(invented)}"


# --- a real Prometheus 3.16 evaluating the rules over gpuguard's live /metrics ----------------


def test_a_real_prometheus_names_the_stopped_pod_and_no_other(
    prometheus: Path, tmp_path: Path
) -> None:
    # `gpuguard demo` runs the real pipeline on a simulated node: trainer-greedy is stopped, the
    # exempt benchmark stays above its limit (and must not be named by the kill alert).
    metrics_port = free_port()
    with demo_under_prometheus(
        prometheus, tmp_path, demo_seconds=90, metrics_port=metrics_port, rule_files=[RULES]
    ) as run:
        killed: list[dict[str, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            time.sleep(1)
            with contextlib.suppress(OSError):
                alerts = get_json(f"{run.api}/alerts")["data"]["alerts"]
                killed = [
                    a["labels"]
                    for a in alerts
                    if a["labels"]["alertname"] == "GPUGuardContainerKilled"
                    and a["state"] == "firing"
                ]
        assert killed, run.log.read_text()[-3000:]
        assert [(k.get("namespace"), k.get("pod"), k.get("gpu")) for k in killed] == [
            ("ml-team", "trainer-greedy", "0")
        ], killed
        assert killed[0]["severity"] == "warning"
        assert killed[0]["hostname"] == "demo-node"
        rules = [r for g in get_json(f"{run.api}/rules")["data"]["groups"] for r in g["rules"]]
        assert sorted(r["name"] for r in rules) == sorted(ALERTS)
        assert all(r["health"] == "ok" for r in rules), rules
