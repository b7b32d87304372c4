"""The docs say what the code does: docs/install.md's limit snippet computes what gpuguard
computes, every reference to the design document points at a section it has, and nothing in the
repository cites a document the repository does not hold."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.kubemodel.quantity import InvalidQuantity, parse_limit
from rigs.prereq import require
from tests.doc_figures import Table, is_measurement, markdown_tables

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "docs" / "install.md"
DESIGN = ROOT / "docs" / "design.md"
GI = 1 << 30
TOTAL = 80 * GI
"""The device the snippet and gpuguard resolve limits on (an H100's 80 GiB)."""


class FakeTorch(types.ModuleType):
    """The two torch calls the snippet makes: the device's total memory, and the cap it sets."""

    def __init__(self, total_memory: int) -> None:
        super().__init__("torch")
        self.fractions: list[tuple[float, int]] = []
        properties = types.SimpleNamespace(total_memory=total_memory)
        self.cuda = types.SimpleNamespace(
            get_device_properties=lambda index: properties,
            set_per_process_memory_fraction=self._set_fraction,
        )

    def _set_fraction(self, fraction: float, device: int) -> None:
        self.fractions.append((fraction, device))


def install_snippet() -> str:
    """The Python block of docs/install.md that defines ``limit_bytes``."""
    blocks = re.findall(r"```python\n(.*?)```", INSTALL.read_text(encoding="utf-8"), re.DOTALL)
    found = [block for block in blocks if "def limit_bytes" in block]
    assert len(found) == 1, "docs/install.md must have one Python block defining limit_bytes"
    return str(found[0])


def run_snippet(
    monkeypatch: pytest.MonkeyPatch, limit: str | None, total: int = TOTAL
) -> tuple[dict[str, Any], FakeTorch]:
    torch = FakeTorch(total)
    monkeypatch.setitem(sys.modules, "torch", torch)
    if limit is None:
        monkeypatch.delenv("GPU_MEMORY_LIMIT", raising=False)
    else:
        monkeypatch.setenv("GPU_MEMORY_LIMIT", limit)
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(compile(install_snippet(), str(INSTALL), "exec"), namespace)
    return namespace, torch


def gpuguards_bytes(text: str, total: int = TOTAL) -> int | None:
    """What the enforcer holds a pod with this annotation to on a ``total``-byte device."""
    try:
        return parse_limit(text).resolve(total)
    except InvalidQuantity:
        return None


VALID = [
    # every suffix Kubernetes knows, binary and decimal
    "8Gi", "8192Mi", "8388608Ki", "1Ti", "1Pi", "1Ei", "0.5Ti",
    "8G", "8000M", "8000000k", "2T", "1P", "1E", "8000000000",
    "2000000000000m", "8000000000000000u", "8000000000000000000n",
    # decimal exponents, the case the old snippet raised on
    "8e9", "8E9", "8e+9", "1.5e9", "1.e9", ".5e10", "80e8", "8000000000e-1", "1e19", "1e300",
    # fractions, a leading sign, fractional bytes (round up)
    "1.5Gi", ".5Gi", "5.Gi", "+8Gi", "8.000001Gi", "1.0000001G", "1048576.5",
    # percentages of the device
    "25%", "12.5%", "100%", "0.5%", "+50%",
    # at the smallest limit gpuguard accepts
    "1Mi", "1048576", "1.048576M",
]  # fmt: skip

REJECTED = [
    # rejected by gpuguard and by the snippet: a limit nobody gets
    "8GB", "8 Gi", "8gi", "8ki", "", "0", "0Gi", "-1Gi", "-5%", "0%", "150%", "abc", "8Gi1",
    "1e3k", "16", "8k", "100m", "1Ki", "1" * 65,
    # "K" is not a Kubernetes suffix (the API server refuses "8K" as a quantity)
    "8000K", "2000000K",
]  # fmt: skip


@pytest.mark.parametrize("text", VALID)
def test_the_install_snippet_computes_the_bytes_gpuguard_enforces(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    namespace, _ = run_snippet(monkeypatch, None)
    limit_bytes: Callable[[str, int], int | None] = namespace["limit_bytes"]
    expected = gpuguards_bytes(text)
    assert expected is not None, f"{text!r} is meant to be valid"
    assert limit_bytes(text, TOTAL) == expected


@pytest.mark.parametrize("text", REJECTED)
def test_the_install_snippet_caps_nothing_for_a_value_kubernetes_or_gpuguard_rejects(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    namespace, _ = run_snippet(monkeypatch, None)
    assert namespace["limit_bytes"](text, TOTAL) is None
    if "K" not in text:  # gpuguard's parser takes "K" as "k" (left for its own issue)
        assert gpuguards_bytes(text) is None


def test_the_install_snippet_sets_pytorchs_cap_below_the_limit_and_never_above_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, torch = run_snippet(monkeypatch, "8e9")
    [(fraction, device)] = torch.fractions
    assert fraction == pytest.approx((8e9 - GI) / TOTAL)
    assert device == 0
    _, torch = run_snippet(monkeypatch, "1Ei")
    assert torch.fractions == [(1.0, 0)]
    _, torch = run_snippet(monkeypatch, "8K")
    assert torch.fractions == []
    _, torch = run_snippet(monkeypatch, None)
    assert torch.fractions == []


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped,
    spaces as hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


USER_FACING = [
    ROOT / "README.md",
    ROOT / "config.example.toml",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "helm" / "gpuguard" / "values.yaml",
    ROOT / "helm" / "gpuguard" / "values.schema.json",
]
"""What users read. The CLI's help is checked in tests/test_cli.py; code comments and docstrings
are not user-facing."""


def test_every_reference_to_the_design_document_names_a_section_it_has() -> None:
    sections = anchors(DESIGN.read_text(encoding="utf-8"))
    seen = 0
    for path in [*USER_FACING, ROOT / "gpuguard" / "cli.py"]:
        for anchor in re.findall(r"design\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            seen += 1
            assert anchor in sections, f"{path.relative_to(ROOT)}: design.md#{anchor}"
    assert seen >= 20


def test_no_user_facing_text_cites_a_design_section_readers_cannot_open() -> None:
    for path in USER_FACING:
        text = path.read_text(encoding="utf-8")
        assert not OLD_DESIGN.search(joined(text)), path.relative_to(ROOT)


# ---------------------------------------------------------------------------------------------
# Every citation resolves inside the repository

OLD_DESIGN = re.compile(r"DESIGN ?(?:§|\.md\b)")
"""The design document's old name and numbered sections: it is ``docs/design.md`` now, whose
sections have names, not numbers."""

UNRESOLVABLE = re.compile(
    OLD_DESIGN.pattern
    + r"|§ ?\d"  # a numbered section of a document that is not here
    + r"|\.\./shared\b"  # a sibling checkout next to the repository
    + r"|\b(?i:reliability[- ]matrix)\b"  # the matrix; its rows are docs/reliability.md's
    + r"|\breference/[\w.-]+\.md\b"  # reference notes kept outside the repository
)
"""Citations of documents a reader of the repository cannot open. ``docs/`` and CHANGELOG.md are
history and prose about those documents, and are not scanned."""

NOT_SCANNED = ("docs/", "CHANGELOG.md", "tests/test_docs.py")
"""Also this file: its examples are the forms it forbids."""

PENDING: dict[str, str] = {}
"""Files another change is editing, with why, each to be fixed and removed from here. Keep it
empty."""

DESIGN_CITATION = re.compile(r"docs/design\.md, ")
"""``docs/design.md, <Section>``: the form comments and docstrings cite the design by."""


def joined(text: str) -> str:
    """``text`` with each line break, its indentation and a continued comment's marker (``#``,
    ``//``) as one space, so that a citation wrapped over two lines is read whole."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#+|//)?[ \t]*", " ", text)


def tracked_files() -> list[str]:
    """The repository's tracked files (``git ls-files``): what a reader of a clone sees."""
    require(shutil.which("git") is not None and (ROOT / ".git").exists(), "needs a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def unresolvable_citations(text: str) -> list[str]:
    """Each citation in ``text`` of a document the repository does not hold."""
    return [match.group(0) for match in UNRESOLVABLE.finditer(joined(text))]


def design_sections() -> list[str]:
    """docs/design.md's heading texts, longest first (so a section never matches as a prefix of
    a longer one's citation)."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", DESIGN.read_text(encoding="utf-8"), re.MULTILINE)
    return sorted(headings, key=len, reverse=True)


def unknown_design_sections(text: str, sections: list[str]) -> list[str]:
    """Each ``docs/design.md, <Section>`` in ``text`` whose section is not a heading there."""
    text = joined(text)
    return [
        text[match.end() : match.end() + 40]
        for match in DESIGN_CITATION.finditer(text)
        if not any(text.startswith(section, match.end()) for section in sections)
    ]


@pytest.mark.parametrize(
    "text",
    [
        "(DESIGN §5.3)",
        "see DESIGN.md",
        "# (reliability matrix R3)",
        "(reliability-matrix S1)",
        "Reliability-matrix rows that had no test",
        "its rules (reliability\n    # matrix F1, F2)",
        "(../shared/reference/tools.md)",
        "(``reference/nvml-cgroups-k8s.md`` §2.2)",
        "the P9 rule of §5.4",
    ],
)
def test_the_guard_catches_each_form_of_unresolvable_citation(text: str) -> None:
    assert unresolvable_citations(text)


@pytest.mark.parametrize(
    "text",
    [
        "(docs/design.md, Sharing config)",
        "(docs/reliability.md R3)",
        "docs/design.md#helm-values",
        "DESIGN_METRICS = frozenset()",
        "the sharing references (``references_not_checked``)",
        "a dereference/pointer.md",
    ],
)
def test_the_guard_passes_citations_the_repository_resolves(text: str) -> None:
    assert not unresolvable_citations(text)


def test_no_file_outside_docs_cites_a_document_the_repository_does_not_hold() -> None:
    found = {}
    for name in tracked_files():
        if name.startswith(NOT_SCANNED) or name in PENDING:
            continue
        text = (ROOT / name).read_bytes().decode("utf-8", errors="replace")
        if cited := unresolvable_citations(text):
            found[name] = cited
    assert found == {}, (
        "cite docs/design.md sections, docs/reliability.md rows or the reason in words instead"
    )


OWN_ISSUE = re.compile(r"\b(?i:issues?)[ -]?#?\d+")
"""A citation of one of the project's own issues: the word "issue" or "issues", in any case,
then a number, with a space, a hyphen, a ``#`` or nothing between (the examples below). A
reader of the repository cannot open the tracker it lived in, so the text says the reason
itself. Another project's issue is cited as ``owner/repo#N``
(``NVIDIA/nvidia-container-toolkit#48``), which this does not match."""

KEPT_RECORDS = ("docs/results/", "docs/e2e-runs/")
"""Raw outputs, kept as they were printed: records, never rewritten."""


def own_issue_citations(text: str) -> list[str]:
    """Each citation in ``text`` of one of the project's own issues. A path of a kept record
    (a folder of ``docs/e2e-runs/`` named after an issue) is a file name, not a citation."""
    return [match.group(0) for match in OWN_ISSUE.finditer(RAW_OUTPUT.sub("", joined(text)))]


@pytest.mark.parametrize(
    "text",
    [
        # ``{n}`` stands for the number, so that this file is scanned like the rest.
        "### Fixed (issue {n}: found by the soak)",
        '"""Issue {n}: gpuguard idle costs"""',
        "the H100 runs of issue {n}",
        "issues {n} and 25",
        "(issue-{n})",
        "see issue #{n}",
        "an issue{n} folder",
        "the tests of issue\n    # {n}",
        "(toolkit issue #{n})",
    ],
)
def test_the_guard_catches_each_form_of_own_issue_citation(text: str) -> None:
    assert not own_issue_citations(text)
    assert own_issue_citations(text.format(n=27))


@pytest.mark.parametrize(
    "text",
    [
        "(NVIDIA/nvidia-container-toolkit#48, #1227)",
        "kubernetes/kubernetes#12345",
        "Kludex/uvicorn#157",
        "docs/e2e-runs/2026-12-06-issue{n}/e2e-stdout.txt",
        "the issue is 27 bytes long",
        "tissues 4",
    ],
)
def test_the_guard_passes_what_is_not_an_own_issue_citation(text: str) -> None:
    assert not own_issue_citations(text.format(n=27))


def test_no_tracked_file_cites_an_issue_of_the_projects_own() -> None:
    found = {}
    for name in tracked_files():
        if name.startswith(KEPT_RECORDS):
            continue
        data = (ROOT / name).read_bytes()
        if b"\0" in data:  # binary
            continue
        if cited := own_issue_citations(data.decode("utf-8", errors="replace")):
            found[name] = cited
    assert found == {}, "say the reason or the subject itself, not the issue it came from"


def test_every_design_section_cited_is_a_heading_of_docs_design_md() -> None:
    sections = design_sections()
    slugs = anchors(DESIGN.read_text(encoding="utf-8"))
    assert unknown_design_sections("docs/design.md, Fast path and", sections) == []
    assert unknown_design_sections("docs/design.md,\n    # Limit sources)", sections) == []
    assert unknown_design_sections("(docs/design.md, Fast paths)", sections) == []
    assert unknown_design_sections("(docs/design.md, §5.1)", sections) == ["§5.1)"]
    seen = 0
    for name in tracked_files():
        if name in ("CHANGELOG.md", "tests/test_docs.py"):
            continue
        text = (ROOT / name).read_bytes().decode("utf-8", errors="replace")
        seen += len(DESIGN_CITATION.findall(joined(text)))
        assert unknown_design_sections(text, sections) == [], name
        for anchor in re.findall(r"design\.md#([\w-]+)", text):
            assert anchor in slugs, f"{name}: design.md#{anchor}"
    assert seen >= 80


# ---------------------------------------------------------------------------------------------
# Every figure in docs/ names the script that produced it and keeps its raw output

RAW_OUTPUT = re.compile(r"docs/(?:results|e2e-runs)/[\w.+-]+(?:/[\w.+-]+)*/?")
"""A path to kept raw output: a file of ``docs/results/`` or a run's folder of
``docs/e2e-runs/``."""

COMMAND = re.compile(r"\b(?:benchmarks|scripts|tests)/[\w/]+\.py\b")
"""What a measurement's section must name: the script (or test) that printed its figures."""

NOT_KEPT: dict[tuple[str, str], str] = {
    ("performance.md", "Poll cost, real GPU (2026-12-02, NVIDIA H200)"): "H200, 2026-12-02, "
    "before raw output was kept; no H200 lent since; today's figures are the H100 rerun",
    (
        "performance.md",
        "H200, four watchers, 20 trials each (2026-12-03 16:41 UTC, gpuguard `abea55c`)",
    ): "H200, 2026-12-03, before raw output was kept; no H200 lent since; today's figures are "
    "the H100 runs after the quiet gate and process pins",
    ("soak.md", "Run B: 40 minutes (the picture), `f217c09`"): "2026-12-03 soak before "
    "the enforcer's untangling; raw output not kept; today's figures are Run E",
    ("soak.md", "Run A: 30 minutes, `03a0334`"): "2026-12-03 soak before the enforcer's "
    "untangling; raw output not kept; today's figures are Run E",
    ("scale.md", "Summary"): "1000 kwok nodes on a 16-vCPU machine with a real control plane, "
    "2026-12-03; raw output not kept, not reproducible on today's machines",
    **{
        ("scale.md", heading): "kwok control plane at 250-1000 nodes, 2026-12-03; raw output "
        "not kept, not reproducible on today's machines"
        for heading in (
            "Steady state, 180 s each, back to back (the 250-node run; the 500-node run is "
            'under "Linearity")',
            "Watchers' start",
            "Sharing-config change",
            "All 1000 nodes on a 16-vCPU machine",
            "Linearity: 250, 500 and 1000 nodes",
            "Plan item 1 tried: gpuguard in its own APF priority level (500 nodes)",
            "What grows with the cluster",
            "Machine and date",
        )
    },
}
"""Measurement tables whose raw output is lost and whose run cannot be repeated here, each
labelled as such in its doc (machine, date, commit, command); keyed by (doc, heading)."""

PENDING_FIGURES: dict[tuple[str, str], str] = {}
"""Measurement tables another change is rerunning, with why, each to be marked and removed from
here. Keep it empty."""


def row_name(cell: str) -> str:
    """A row's first cell as the script printed it: Markdown's emphasis and code marks off."""
    return re.sub(r"\*\*|`", "", cell).strip()


def raw_text(root: Path, paths: list[str]) -> str:
    """Everything the raw output at ``paths`` holds (a folder: each file in it)."""
    files = []
    for path in paths:
        kept = root / path
        files += sorted(f for f in kept.rglob("*") if f.is_file()) if kept.is_dir() else [kept]
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def figure_problems(doc: str, text: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the measurement tables of one doc: a table with neither a marker nor
    an entry above, a marker naming raw output that is not there, a section that names no
    script, a row the raw output does not print."""
    problems = []
    for table in markdown_tables(text):
        key = (doc, table.heading)
        if table.marker is None:
            if is_measurement(table) and key not in NOT_KEPT and key not in PENDING_FIGURES:
                problems.append(f"{doc} '{table.heading}': a measurement table without a marker")
            continue
        paths = table.marker.split()
        missing = [p for p in paths if not RAW_OUTPUT.fullmatch(p) or not (root / p).exists()]
        if missing or not paths:
            problems.append(f"{doc} '{table.heading}': raw output missing: {missing}")
            continue
        if not COMMAND.search(table.section):
            problems.append(f"{doc} '{table.heading}': its section names no script")
        printed = raw_text(root, paths)
        for row in table.rows:
            if row_name(row[0]) not in printed:
                problems.append(f"{doc} '{table.heading}': row {row[0]!r} is not in {paths}")
        problems += [
            f"{doc} '{table.heading}': row {' | '.join(row)!r} is not as {paths} print it"
            for row in rows_not_as_printed(table, printed)
        ]
    return problems


def rows_not_as_printed(table: Table, printed: str) -> list[list[str]]:
    """The rows of ``table`` that no table of ``printed`` with its header holds, value for
    value (emphasis aside); none when ``printed`` has no table with that header."""
    copied = [t for t in markdown_tables(printed) if t.header == table.header]
    if not copied:
        return []
    held = [[row_name(cell) for cell in row] for t in copied for row in t.rows]
    return [row for row in table.rows if [row_name(cell) for cell in row] not in held]


def test_every_kept_raw_output_a_doc_names_exists() -> None:
    named = 0
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for found in RAW_OUTPUT.findall(path.read_text(encoding="utf-8")):
            named += 1
            cited = found.rstrip(".")
            assert (ROOT / cited).exists(), f"{path.relative_to(ROOT)} names {cited}"
    assert named >= 10


def test_every_measurement_table_names_its_script_and_keeps_its_raw_output() -> None:
    problems = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        problems += figure_problems(path.name, path.read_text(encoding="utf-8"))
    assert problems == []


def test_the_lists_of_unmarked_tables_name_tables_that_exist() -> None:
    present = {
        (path.name, table.heading)
        for path in (ROOT / "docs").glob("*.md")
        for table in markdown_tables(path.read_text(encoding="utf-8"))
    }
    assert set(NOT_KEPT) - present == set()
    assert set(PENDING_FIGURES) - present == set()


SYNTHETIC_RAW = "| wait | 1000 | 0 |\n| stamp | 1000 | 0 |\n"
"""What a synthetic script printed, kept at docs/results/x.txt of a synthetic checkout."""


def synthetic_doc(
    marker: str, section: str = "`benchmarks/x.py --trials 1000`", rows: str = ""
) -> str:
    rows = rows or "| wait | 1000 | 0 |\n| stamp | 1000 | 0 |\n"
    head = "| mode | trials | wrong |\n|---|---:|---:|\n"
    return f"# X\n\n## Results\n\n{section}\n\n{marker}\n\n{head}{rows}"


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        (synthetic_doc(""), "a measurement table without a marker"),
        (synthetic_doc("<!-- figures: docs/results/gone.txt -->"), "raw output missing"),
        (synthetic_doc("<!-- figures: /tmp/x.txt -->"), "raw output missing"),
        (
            synthetic_doc("<!-- figures: docs/results/x.txt -->", section="as before"),
            "names no script",
        ),
        (
            synthetic_doc("<!-- figures: docs/results/x.txt -->", rows="| bare | 1000 | 227 |\n"),
            "row 'bare' is not in",
        ),
        (
            synthetic_doc(
                "<!-- figures: docs/results/x.txt -->", rows="| wait (the default) | 1000 | 0 |\n"
            ),
            "is not in",
        ),
    ],
)
def test_the_figures_check_fails_on_each_kind_of_untraceable_table(
    tmp_path: Path, doc: str, problem: str
) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "x.txt").write_text(SYNTHETIC_RAW, encoding="utf-8")
    [found] = figure_problems("x.md", doc, root=tmp_path)
    assert problem in found


@pytest.mark.parametrize(
    "doc",
    [
        synthetic_doc("<!-- figures: docs/results/x.txt -->"),
        synthetic_doc("<!-- figures: docs/results/x.txt -->", rows="| **wait** | 1000 | **0** |\n"),
        "# X\n\n| alert | severity |\n|---|---|\n| Down | warning |\n",  # no figure in it
        "# X\n\n| pod | limit |\n|---|---|\n| `kai` 0.1 | 8Gi |\n",  # quantities are no figures
        "# X\n\n```\n| a | 1 |\n|---|---|\n| b | 2 |\n```\n",  # fenced: not a table
    ],
)
def test_the_figures_check_passes_a_traceable_table_and_tables_without_figures(
    tmp_path: Path, doc: str
) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "x.txt").write_text(SYNTHETIC_RAW, encoding="utf-8")
    assert figure_problems("x.md", doc, root=tmp_path) == []


OUTPUT = re.compile(r"^<!-- output: (\S+) -->\n```[a-z]*\n(.*?)\n```", re.MULTILINE | re.DOTALL)
"""A command's output shown in a doc, right below the kept raw output it was copied from."""


def output_problems(text: str, *, root: Path) -> list[str]:
    """Each ``<!-- output: FILE -->`` block that is not FILE's text (trailing spaces aside)."""
    problems = []
    for path, shown in OUTPUT.findall(text):
        raw = root / path
        if not raw.is_file():
            problems.append(f"{path}: raw output missing")
            continue
        kept = "\n".join(line.rstrip() for line in raw.read_text(encoding="utf-8").splitlines())
        if shown.strip("\n") != kept.strip("\n"):
            problems.append(f"{path}: the doc's block differs from the kept output")
    return problems


def test_every_output_shown_in_the_docs_is_its_kept_raw_output() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    shown = {d.name: d.read_text(encoding="utf-8") for d in docs}
    assert any(OUTPUT.search(text) for text in shown.values())
    problems = [
        f"{name}: {p}" for name, text in shown.items() for p in output_problems(text, root=ROOT)
    ]
    assert problems == []


def test_the_output_check_fails_on_an_edited_block(tmp_path: Path) -> None:
    (tmp_path / "raw.txt").write_text("PID  USED\n517  2568Mi   \n", encoding="utf-8")
    good = "<!-- output: raw.txt -->\n```text\nPID  USED\n517  2568Mi\n```\n"
    assert output_problems(good, root=tmp_path) == []
    edited = good.replace("2568Mi", "2000Mi")
    assert output_problems(edited, root=tmp_path) == [
        "raw.txt: the doc's block differs from the kept output"
    ]
    assert output_problems(good.replace("raw.txt", "gone.txt"), root=tmp_path) == [
        "gone.txt: raw output missing"
    ]


def test_a_table_copied_whole_is_checked_value_for_value(tmp_path: Path) -> None:
    """Where the raw output prints the table's header, its rows must be printed rows, every
    value as printed: a changed figure under a printed row name is caught."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    printed = "# a header line\n| mode | trials | wrong |\n|---|---:|---:|\n" + SYNTHETIC_RAW
    (tmp_path / "docs" / "results" / "x.txt").write_text(printed, encoding="utf-8")
    marker = "<!-- figures: docs/results/x.txt -->"
    assert figure_problems("x.md", synthetic_doc(marker), root=tmp_path) == []
    emphasised = synthetic_doc(marker, rows="| **wait** | 1000 | **0** |\n")
    assert figure_problems("x.md", emphasised, root=tmp_path) == []
    changed = synthetic_doc(marker, rows="| wait | 1000 | 3 |\n")
    [found] = figure_problems("x.md", changed, root=tmp_path)
    assert "row 'wait | 1000 | 3' is not as" in found
    # A row of another printed table of other columns is not this table's.
    other = printed + "\n| mode | trials | late |\n|---|---:|---:|\n| wait | 1000 | 3 |\n"
    (tmp_path / "docs" / "results" / "x.txt").write_text(other, encoding="utf-8")
    assert len(figure_problems("x.md", changed, root=tmp_path)) == 1


# ---------------------------------------------------------------------------------------------
# Where the image comes from, said before the install command, with the chart's real values

IMAGE_DOCS = [ROOT / "README.md", INSTALL]


def before_the_install_command(path: Path) -> str:
    """The doc's text up to its first ``helm upgrade --install``."""
    text = path.read_text(encoding="utf-8")
    at = text.find("helm upgrade --install")
    assert at > 0, f"{path.name}: no install command"
    return " ".join(text[:at].split())


def chart_default_image() -> str:
    values = yaml.safe_load((ROOT / "helm" / "gpuguard" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm" / "gpuguard" / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def image_value_flags(text: str) -> set[str]:
    """The chart values a doc's ``--set image.X=`` flags name."""
    return set(re.findall(r"--set (image\.[A-Za-z]+)=", text))


@pytest.mark.parametrize("path", IMAGE_DOCS, ids=lambda p: p.name)
def test_the_install_docs_say_where_the_image_comes_from_before_the_install_command(
    path: Path,
) -> None:
    """The chart's default image is not published by the repository: before the first install
    command the doc names it, says so, says how to build and push one, and which values point
    the chart at it; those values are the chart's own (values.yaml's ``image`` map)."""
    text = before_the_install_command(path)
    assert f"`{chart_default_image()}`" in text
    assert "not published by this repository" in text
    for command in ("make image", "make push-image IMAGE_REPOSITORY="):
        assert command in text, f"{path.name}: {command!r} not said before the install command"
    values = yaml.safe_load((ROOT / "helm" / "gpuguard" / "values.yaml").read_text())
    flags = image_value_flags(text)
    assert flags == {"image.repository", "image.tag"}
    assert {flag.removeprefix("image.") for flag in flags} <= set(values["image"])


def build_options(*command: str) -> set[str]:
    """The ``NAME=`` settings a command's usage text lists."""
    done = subprocess.run(
        list(command), cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return set(re.findall(r"\b((?:BASE|IMAGE)_[A-Z]+)=", done.stdout))


def test_the_image_options_the_docs_name_are_the_ones_the_scripts_and_make_help_list() -> None:
    """Every ``BASE_*=`` / ``IMAGE_*=`` setting README and docs/install.md give ``make image`` or
    ``make push-image`` is one scripts/build-image.sh's or scripts/push-image.sh's usage lists,
    and both ways to choose a base are in ``make help``."""
    known = build_options("bash", "scripts/build-image.sh", "--help") | build_options(
        "bash", "scripts/push-image.sh", "--help"
    )
    assert {"BASE_IMAGE", "BASE_ARCHIVE", "IMAGE_REPOSITORY", "IMAGE_TAG"} <= known
    for path in IMAGE_DOCS:
        named = set(re.findall(r"\b((?:BASE|IMAGE)_[A-Z]+)=", path.read_text(encoding="utf-8")))
        assert named <= known, f"{path.name} names settings no script reads: {named - known}"
    assert {"BASE_IMAGE", "BASE_ARCHIVE", "IMAGE_REPOSITORY", "IMAGE_TAG"} <= build_options(
        "make", "--no-print-directory", "help"
    )
