"""The docs a new admin reads first say what the repository does: every link's anchor is a
heading of its target, the user docs name source files by paths that exist, ``make help`` lists
what the docs tell people to run, the README's metrics table names each series' exported
labels, docs/alerts.md names the job the chart's Service gives, the README's cost line quotes
the chart's requests and a kept raw output, and docs/install.md says what an upgrade and an
uninstall do (what stays on the nodes, from the code's own names)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuguard.core.reconcile import CORDONED_BY_ANNOTATION
from gpuguard.core.sharing import SHARING_LABELS
from rigs import controlplane
from rigs.prereq import require
from tests.chart_release import NAMESPACE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INSTALL = ROOT / "docs" / "install.md"
CHART = ROOT / "helm" / "gpuguard"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
USER_DOCS = [README, *(ROOT / "docs" / name for name in ("install.md", "dra.md", "alerts.md"))]
"""Docs written for cluster admins, which name files from the repository's root (design.md
names package modules by their path under gpuguard/, as its own convention)."""

FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path, *, explicit: bool = True) -> set[str]:
    """Every anchor of a Markdown file: its headings' (numbered when repeated) and, with
    ``explicit``, its ``<a id>``s (raw HTML some renderers drop)."""
    text = path.read_text(encoding="utf-8")
    found = set(re.findall(r'<a id="([^"]+)"', text)) if explicit else set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", text), re.MULTILINE):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_anchors(path: Path, *, explicit: bool = True) -> list[str]:
    broken = []
    for target, fragment in LINK.findall(FENCED.sub("", path.read_text(encoding="utf-8"))):
        linked = path if not target else (path.parent / target).resolve()
        if linked.suffix == ".md" and (
            not linked.exists() or fragment not in anchors(linked, explicit=explicit)
        ):
            broken.append(f"{target}#{fragment}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_link_anchor_names_a_heading_of_its_target(path: Path) -> None:
    assert broken_anchors(path) == []


@pytest.mark.parametrize("path", USER_DOCS, ids=[p.name for p in USER_DOCS])
def test_the_user_docs_link_headings_not_raw_html_ids(path: Path) -> None:
    """An admin may read them where raw HTML is dropped (an ``<a id>`` then anchors nothing)."""
    assert broken_anchors(path, explicit=False) == []


def test_the_anchor_check_catches_a_missing_heading(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# B\n\n### 5. Check a manifest before it ships\n")
    doc.write_text(
        "# A\n\n## What it does\n\n[x](#what-it-does) [y](b.md#5-check-a-manifest-before-it-ships)"
        " [z](#what-it-did) [w](b.md#check-a-manifest)\n"
    )
    assert broken_anchors(doc) == ["#what-it-did", "b.md#check-a-manifest"]


SOURCE_PATH = re.compile(r"`([\w./-]+/[\w.-]+\.py)(?:::\w+)?`")


@pytest.mark.parametrize("path", USER_DOCS, ids=[p.name for p in USER_DOCS])
def test_the_user_docs_name_source_files_by_paths_that_exist(path: Path) -> None:
    named = SOURCE_PATH.findall(path.read_text(encoding="utf-8"))
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_make_help_lists_every_make_target_the_docs_name() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = {
        target
        for path in DOCS
        for target in re.findall(r"\bmake ([a-z][\w-]*)", path.read_text(encoding="utf-8"))
        if target in targets
    }
    assert {"demo", "dra-demo", "test", "e2e-node"} <= named
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "help"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    listed = set(re.findall(r"\bmake ([a-z][\w-]*)", done.stdout))
    assert named - listed == set()


def readme_metric_labels() -> dict[str, set[str]]:
    """The README's metrics table: metric → its label names (``same`` and ``as the per-pod
    series`` resolved)."""
    after = README.read_text(encoding="utf-8").split("\n## Metrics\n", 1)[1]
    section = after.strip("\n").split("\n\n", 1)[0]
    labels: dict[str, set[str]] = {}
    previous: set[str] = set()
    per_pod: set[str] = set()
    for row in section.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name, written = cells[0].strip("`"), cells[1]
        if written == "same":
            found = previous
        elif written.startswith("as the per-pod series"):
            found = per_pod
        else:
            found = set(written.strip("`").split())
        labels[name] = found
        if name == "gpuguard_pod_gpu_memory_used_bytes":
            per_pod = found
        previous = found
    return labels


def test_the_readme_metrics_table_names_each_series_labels_as_exported() -> None:
    from tests.exported_metrics import exported

    series = exported()
    documented = readme_metric_labels()
    assert "gpuguard_pod_gpu_memory_used_bytes" in documented
    wrong = {
        name: (sorted(labels), sorted(series[name]))
        for name, labels in documented.items()
        if name in series and labels != set(series[name])
    }
    assert wrong == {}


@pytest.fixture(scope="module")
def helm() -> Path:
    binary = controlplane.testbin_dir() / "helm"
    require(os.access(binary, os.X_OK), f"missing {binary}: run scripts/ensure-testbin.sh")
    return binary


@pytest.mark.parametrize(
    ("release", "job"),
    [("gpuguard", "gpuguard-metrics"), ("prod", "prod-gpuguard-metrics")],
)
def test_the_alerts_doc_names_the_job_the_charts_service_gives(
    helm: Path, tmp_path: Path, release: str, job: str
) -> None:
    """A ServiceMonitor's job is its Service's name: the one the chart renders, for the release
    name the docs use and another."""
    done = subprocess.run(
        [str(helm), "template", release, str(CHART), "-n", NAMESPACE,
         "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services] == [job]
    assert re.fullmatch(".*gpuguard.*", job)
    assumes = (ROOT / "docs" / "alerts.md").read_text(encoding="utf-8")
    assert "`gpuguard-metrics` for a release named `gpuguard`" in assumes
    assert "any other `<release>-gpuguard-metrics`" in assumes


def test_the_readmes_cost_line_quotes_the_charts_requests_and_a_kept_raw_output() -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    line = text.split("**What it costs, how fast it acts:**", 1)[1].split("**", 1)[0]
    resources = yaml.safe_load((CHART / "values.yaml").read_text())["resources"]
    enforcer, agent = resources["enforcer"], resources["agent"]
    assert (
        f"{enforcer['requests']['cpu']} CPU and {enforcer['requests']['memory']} of memory for "
        f"the enforcer and {agent['requests']['cpu']} CPU and {agent['requests']['memory']} for "
        "the agent"
    ) in line
    assert f"(limits {enforcer['limits']['memory']} and {agent['limits']['memory']};" in line
    (raw,) = re.findall(r"\(docs/results/([\w.-]+\.txt)\)", line)
    p50, p99 = re.findall(r"(\d+) ms", line)[:2]
    kept = (ROOT / "docs" / "results" / raw).read_text(encoding="utf-8")
    (row,) = [r for r in kept.splitlines() if r.startswith("| gpuguard change-driven")]
    assert f"| {p50} / {p99} |" in row


def test_the_install_doc_says_how_to_upgrade_and_what_an_uninstall_leaves() -> None:
    text = INSTALL.read_text(encoding="utf-8")
    upgrade = text.split("## Upgrading between chart versions", 1)[1].split("\n## ", 1)[0]
    (install,) = re.findall(r"<!-- walkthrough -->\n```sh\n(helm upgrade --install [^\n]+)", text)
    assert install in upgrade, "the upgrade is the install command run again"
    uninstall = " ".join(text.split("## Uninstalling", 1)[1].split("\n## ", 1)[0].split())
    assert f"helm uninstall gpuguard -n {NAMESPACE}" in uninstall
    lock_dir = re.search(
        r'"lock_file" "(/[\w/]+)/[\w.]+"', (CHART / "templates" / "_helpers.tpl").read_text()
    )
    assert lock_dir is not None
    stays = [
        f"namespace `{NAMESPACE}`",
        *(f"`{label}`" for label in SHARING_LABELS),
        f"`{CORDONED_BY_ANNOTATION}: agent`",
        f"kubectl annotate node NODE {CORDONED_BY_ANNOTATION}-",
        f"`{lock_dir.group(1)}`",
    ]
    assert [s for s in stays if s not in uninstall] == []
