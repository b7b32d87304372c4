"""Every figure README.md, CHANGELOG.md and docs/ publish as measured checks itself: it is a
reference to the line (or JSON key) of its kept raw output, compared value by value, or it is
marked as a setting or as lost; and every raw output kept from now on starts with the
provenance header (the commit, whether its tree was dirty, the machine, the driver, the
command). The forms are in ``tests/doc_figures.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.doc_figures import (
    mark_problems,
    reference_problems,
    references,
    unreferenced_figures,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "figures"
PUBLISHED = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
"""What the project publishes figures in."""

BEFORE_HEADERS = ROOT / "tests" / "data" / "raw-outputs-before-headers.txt"
"""The raw outputs kept before the provenance header existed (files of docs/results/, run
folders of docs/e2e-runs/), one a line: they say their commit and machine in their own words,
if at all. Every other raw output must start with the header."""

HEADER_FIELDS = ("commit", "dirty", "machine", "gpu driver", "command", "utc")


def problems_of(name: str) -> list[str]:
    doc = FIXTURES / name
    return reference_problems(doc, doc.read_text(encoding="utf-8"))


def test_a_fixture_doc_whose_figures_match_their_raw_output_passes() -> None:
    text = (FIXTURES / "right.md").read_text(encoding="utf-8")
    assert len(list(references(text))) == 10
    assert problems_of("right.md") == []
    assert unreferenced_figures(text) == []


def test_a_planted_wrong_number_fails_the_check_and_each_other_fault_too() -> None:
    found = problems_of("wrong.md")
    expected = [
        "wrong.md:3 [0.968 ms/s]: raw.txt#L4 says",  # one digit off the printed 0.967
        "wrong.md:4 [101 ms]: raw.txt#L4 says",  # the planted wrong number
        "wrong.md:5 [99.1 ms]: raw.txt#L5 says",  # seconds read as milliseconds: no title
        "wrong.md:6 [1 ms]: raw.txt has no line 40",
        "wrong.md:7 [8.59 CPU-seconds]: raw.json has no key",
        "wrong.md:8 [1 run]: raw.json key=runs.0.label is 'current', not a number",
        "wrong.md:9 [0.967 ms]: raw output gone.txt missing",
        "wrong.md:10 [99 ms]: no conversion from 'MiB' to 'ms'",
        "wrong.md:11 [74 / 99 ms]: a reference holds one figure, this holds 2",
        "wrong.md:12 [+10.6 %]: raw.txt#L5 says",
    ]
    assert len(found) == len(expected), found
    for problem, start in zip(found, expected, strict=True):
        assert problem.startswith(start), problem


def test_the_detector_finds_each_kind_of_unreferenced_measured_figure() -> None:
    found = unreferenced_figures((FIXTURES / "unreferenced.md").read_text(encoding="utf-8"))
    assert [figure for _, figure in found] == [
        "~9.7",  # the left side of a measured figure's arrow
        "~2.8 ms/s",  # a decimal with a unit
        "7.6 enforcer CPU-seconds",
        "0.46 µs",
        "428 µs",  # a whole figure in a unit no setting uses
        "101 ms",  # a whole figure after a measuring word (p99)
        "+10.6 %",  # a signed percentage
        "22.7×",  # a ratio
        "18 min",  # "took"
        "40 s",
        "1013",
        "4110 fds",
        "441",  # the left side of a slash: p50 / p99
        "974 ms",  # a whole number of milliseconds no setting would be
        "25×",  # a ratio above 2×
        "3.3 ms",  # a mark in a code span is text
        "1.25 ms",  # in a table the table check does not cover
    ]


def test_the_detector_passes_settings_code_and_marked_figures() -> None:
    text = (FIXTURES / "settings.md").read_text(encoding="utf-8")
    assert unreferenced_figures(text) == []
    assert mark_problems(text) == []


def test_a_lost_figure_must_say_in_words_that_it_was_not_kept() -> None:
    text = (FIXTURES / "unlabelled.md").read_text(encoding="utf-8")
    assert unreferenced_figures(text) == []
    assert mark_problems(text) == ["line 3: a 'not kept' mark whose text does not say so"]


# ---------------------------------------------------------------------------------------------
# Today's docs


def test_every_figure_reference_in_the_docs_matches_its_raw_output() -> None:
    problems, seen = [], 0
    for doc in PUBLISHED:
        text = doc.read_text(encoding="utf-8")
        seen += len(list(references(text)))
        problems += reference_problems(doc, text)
        problems += [f"{doc.name}: {p}" for p in mark_problems(text)]
    assert problems == []
    assert seen >= 20


def test_every_measured_figure_in_the_docs_has_a_reference_or_a_mark() -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{line} {figure}"
        for doc in PUBLISHED
        for line, figure in unreferenced_figures(doc.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        "link each to its raw output's line or key, or mark it: not measured, not kept (and say "
        "so), or derived (tests/doc_figures.py)"
    )


# ---------------------------------------------------------------------------------------------
# Raw outputs: the provenance header


def has_header(path: Path) -> bool:
    """Whether a raw output (a file, or any file of a run's folder) holds the provenance
    header: ``# <field>: …`` lines, or a JSON document's ``provenance`` key."""
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        if all(f"\n# {field}: " in f"\n{text}" for field in HEADER_FIELDS):
            return True
        if file.suffix == ".json":
            try:
                provenance = json.loads(text).get("provenance", {})
            except (ValueError, AttributeError):
                continue
            if all(field in provenance for field in HEADER_FIELDS):
                return True
    return False


def kept_raw_outputs() -> list[str]:
    return sorted(
        str(entry.relative_to(ROOT))
        for folder in ("results", "e2e-runs")
        for entry in (ROOT / "docs" / folder).iterdir()
    )


def test_every_raw_output_kept_from_now_on_starts_with_the_provenance_header() -> None:
    before = set(BEFORE_HEADERS.read_text(encoding="utf-8").split())
    assert before - set(kept_raw_outputs()) == set(), "listed but not kept: remove the line"
    missing = [p for p in kept_raw_outputs() if p not in before and not has_header(ROOT / p)]
    assert missing == [], "a raw output without the header (rigs/provenance.py)"


@pytest.mark.parametrize(
    ("text", "suffix", "held"),
    [
        ("".join(f"# {f}: x\n" for f in HEADER_FIELDS) + "| a | 1 |\n", ".txt", True),
        ("# commit: abc\n# machine: x\n| a | 1 |\n", ".txt", False),
        (json.dumps({"provenance": dict.fromkeys(HEADER_FIELDS, "x"), "runs": []}), ".json", True),
        (json.dumps({"machine": {"commit": "abc"}}), ".json", False),
    ],
)
def test_the_header_check_tells_a_headed_raw_output_from_one_without(
    tmp_path: Path, text: str, suffix: str, held: bool
) -> None:
    raw = tmp_path / f"raw{suffix}"
    raw.write_text(text, encoding="utf-8")
    assert has_header(raw) is held
    assert has_header(tmp_path) is held
