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

from gpuguard.adapters.kube.quantity import InvalidQuantity, parse_limit
from tests.prereq import require

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
