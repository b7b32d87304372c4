"""Every mutation of ``scripts/mutations.py`` still applies: each substitution's text occurs
exactly once in today's file. ``make mutation-check`` finds a text that drifted only after it
has built copies and started their tests; this finds it in a second, beside the change that
moved it (a second fence rendered into the same manifest once made two of them ambiguous)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts_loader import load_script

mutations = load_script("mutations")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "path", "old"),
    [(m.name, p.path, p.old) for m in mutations.MUTATIONS for p in m.patches],
)
def test_each_substitution_matches_exactly_once(name: str, path: str, old: str) -> None:
    text = (REPO / path).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{name}: {old!r} occurs {text.count(old)} times in {path}"
