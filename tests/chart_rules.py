"""The chart's PrometheusRule as the real ``helm template`` renders it: its rule groups, for the
tests that check them with promtool (``tests/test_alert_unbounded.py``) and load them into a
real Prometheus (``tests/integration/test_alert_chain.py``).

Owns: finding helm (the Go-built binary in testbin, ``scripts/ensure-testbin.sh``; missing, it
skips locally and fails in CI through ``rigs.prereq.require``), an environment whose helm state
lives in a directory the caller gives, and reading the PrometheusRule's ``spec.groups`` out of
the rendered chart. Must not edit what helm renders: a test loads the groups as the chart
makes them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rigs import controlplane
from rigs.prereq import require

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "gpuguard"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
"""Passed as ``--api-versions``: the chart renders its PrometheusRule only where the cluster
serves the kind."""

Helm = tuple[Path, dict[str, str]]
"""The helm binary and the environment it runs in."""


def helm_tool(home: Path) -> Helm:
    """helm, with its cache, config and data under ``home``; skips (fails in CI) when the
    binary is missing."""
    binary = controlplane.testbin_dir() / "helm"
    require(os.access(binary, os.X_OK), f"missing {binary}: run scripts/ensure-testbin.sh")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    return binary, env


def rendered_groups(
    helm: Helm, tmp: Path, unbounded: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The PrometheusRule's groups as ``helm template`` renders them, with
    ``prometheusRule.unboundedGPUMemory`` set to ``unbounded`` (``None``: the chart's
    defaults); ``tmp`` holds the values file."""
    binary, env = helm
    args = ["template", "r", str(CHART), "-n", "gpuguard", "--api-versions", PROMETHEUS_RULE_API]
    if unbounded is not None:
        values = tmp / "values.yaml"
        values.write_text(yaml.safe_dump({"prometheusRule": {"unboundedGPUMemory": unbounded}}))
        args += ["-f", str(values)]
    done = subprocess.run(
        [str(binary), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    (rule,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups
