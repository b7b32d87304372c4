#!/usr/bin/env python3
"""Render manifests/ from the Helm chart (helm/gpuguard) with its default values.

The chart is the one source; manifests/ is what `kubectl apply` users get, split by what they
apply when:

- ``rbac.yaml``: the two ServiceAccounts (the enforcer's, the agent's), ClusterRoles, Roles and
  their bindings;
- ``agent-admission-policy.yaml``: the admission fence (ValidatingAdmissionPolicy + binding);
- ``daemonset.yaml``: the config ConfigMap, the metrics Service and the two DaemonSets (the
  enforcer's, the agent's);
- ``dashboard.yaml``: the Grafana dashboard ConfigMap;
- ``agent-eviction-rbac.yaml``: only with ``agent.allow_eviction``: what the chart adds for
  ``agent.allowEviction=true``.

Usage: ``python3 -m scripts.render_manifests [--check] [--helm PATH]``. ``--check`` exits 1 and
names the files that differ from a fresh render (tests/kube/test_manifests.py runs it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "gpuguard"
MANIFESTS = REPO / "manifests"
RELEASE = NAMESPACE = "gpuguard"

HEADER = """\
# GENERATED from helm/gpuguard with {values} (scripts/render_manifests.py); do not edit:
# change the chart and run `python3 -m scripts.render_manifests`. A test fails when they drift.
# {what}
"""

FILES: dict[str, tuple[frozenset[str], str]] = {
    "rbac.yaml": (
        frozenset({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}),
        "Apply first (the namespaces gpuguard and gpu-operator must exist): the enforcer's "
        "and the agent's ServiceAccounts and their RBAC.",
    ),
    "agent-admission-policy.yaml": (
        frozenset({"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}),
        "The admission fences (Kubernetes >= 1.30): the agent's on Nodes, and what the "
        "enforcer's and the agent's accounts may create as Events; apply before the DaemonSets.",
    ),
    "daemonset.yaml": (
        frozenset({"ConfigMap:config", "Service", "DaemonSet"}),
        "The enforcer's DaemonSet and the sharing agent's; audit mode until config.toml says "
        "enforce.",
    ),
    "dashboard.yaml": (
        frozenset({"ConfigMap:dashboard"}),
        'The Grafana dashboard (a ConfigMap labelled grafana_dashboard: "1").',
    ),
}
EVICTION = "agent-eviction-rbac.yaml"


def helm_binary(explicit: str | None) -> str:
    if explicit:
        return explicit
    for candidate in (os.environ.get("TESTBIN_DIR"), str(REPO / "testbin" / "bin")):
        if candidate and os.access(Path(candidate) / "helm", os.X_OK):
            return str(Path(candidate) / "helm")
    return "helm"


def render(helm: str, *sets: str) -> list[tuple[str, dict[str, object]]]:
    """``(source text, object)`` for every document ``helm template`` writes."""
    args = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for value in sets:
        args += ["--set", value]
    with tempfile.TemporaryDirectory(prefix="gpuguard-helm-") as home:
        env = {
            **os.environ,
            **{f"HELM_{d}_HOME": f"{home}/{d}" for d in ("CACHE", "CONFIG", "DATA")},
        }
        out = subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout
    documents = []
    for text in out.split("\n---\n"):
        obj = yaml.safe_load(text)
        if isinstance(obj, dict) and obj.get("kind"):
            documents.append((text.strip("\n-") + "\n", obj))
    return documents


def key(obj: dict[str, object]) -> str:
    kind = str(obj["kind"])
    if kind != "ConfigMap":
        return kind
    labels = (obj.get("metadata") or {}).get("labels") or {}  # type: ignore[union-attr]
    return "ConfigMap:dashboard" if "grafana_dashboard" in labels else "ConfigMap:config"


def join(header: str, texts: Iterable[str]) -> str:
    return header + "---\n".join(texts)


def rendered(helm: str) -> dict[str, str]:
    documents = render(helm)
    files: dict[str, str] = {}
    placed: set[int] = set()
    for name, (kinds, what) in FILES.items():
        picked = [i for i, (_, obj) in enumerate(documents) if key(obj) in kinds]
        placed.update(picked)
        header = HEADER.format(values="its default values", what=what)
        files[name] = join(header, (documents[i][0] for i in picked))
    left = [str(obj["kind"]) for i, (_, obj) in enumerate(documents) if i not in placed]
    if left:
        raise SystemExit(f"render_manifests: no file for {', '.join(left)}: extend FILES")
    default_names = {(str(o["kind"]), str(o["metadata"]["name"])) for _, o in documents}  # type: ignore[index]
    extra = [
        text
        for text, obj in render(helm, "agent.allowEviction=true")
        if (str(obj["kind"]), str(obj["metadata"]["name"])) not in default_names  # type: ignore[index]
    ]
    files[EVICTION] = join(
        HEADER.format(
            values="agent.allowEviction=true",
            what="Apply only with agent.allow_eviction = true: lets migChangePolicy Drain evict "
            "GPU pods (pods/eviction create).",
        ),
        extra,
    )
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if manifests/ would change")
    parser.add_argument("--helm", help="the helm binary (default: testbin/bin/helm, then PATH)")
    args = parser.parse_args(argv)
    files = rendered(helm_binary(args.helm))
    stale = [
        name
        for name, text in files.items()
        if not (MANIFESTS / name).is_file() or (MANIFESTS / name).read_text() != text
    ]
    if args.check:
        if stale:
            print(
                f"manifests/ differ from the chart: {', '.join(stale)}; run "
                "python3 -m scripts.render_manifests",
                file=sys.stderr,
            )
            return 1
        return 0
    for name in stale:
        (MANIFESTS / name).write_text(files[name])
        print(f"wrote manifests/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
