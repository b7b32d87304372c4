"""Every skip goes through ``rigs.prereq.require``: a bare skip would hide a missing prerequisite.

``require`` skips locally and fails in CI (``CI=true``), so CI runs everything. A bare
``pytest.skip``, ``pytest.mark.skip``/``skipif``, ``pytest.importorskip``, ``unittest.skip`` or
``TestCase.skipTest`` skips in CI too, and a test that silently did not run reads as passed.
This test reads every Python file of ``tests/``, ``rigs/`` and ``benchmarks/`` (their syntax
trees, so comments and strings do not count) and fails on any such call outside the allow-list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "rigs", "benchmarks")

# Where a skip outside ``require`` is right, with the reason. Keep it short.
ALLOWED = {
    "rigs/prereq.py": "the rule itself: require() skips locally and fails in CI",
}

SKIPPING_NAMES = frozenset({"skip", "skipif", "importorskip", "skipTest", "SkipTest", "xfail"})
"""Names of pytest's and unittest's skipping calls, marks and exceptions (``xfail`` too: an
expected failure hides a broken prerequisite as well as a skip does)."""


def silent_skips(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each skipping call, mark, exception or import in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SKIPPING_NAMES:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module in ("pytest", "unittest"):
            names = [a.name for a in node.names if a.name in SKIPPING_NAMES]
            found.extend((node.lineno, f"from {node.module} import {n}") for n in names)
    return sorted(found)


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def test_no_test_or_benchmark_skips_outside_require() -> None:
    files = scanned_files()
    assert len(files) > 50, f"only {len(files)} files under {SCANNED}: the scan would prove little"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in files
        if str(path.relative_to(ROOT)) not in ALLOWED
        for line, code in silent_skips(path.read_text())
    ]
    assert not offenders, (
        "skip through rigs.prereq.require (skips locally, fails in CI), or make the test not "
        "need to skip; a justified exception goes in ALLOWED with its reason:\n"
        + "\n".join(offenders)
    )


def test_every_allowed_file_exists_and_still_skips() -> None:
    for name in ALLOWED:
        path = ROOT / name
        assert path.is_file(), f"{name} is allowed to skip but does not exist: drop it"
        assert silent_skips(path.read_text()), f"{name} no longer skips: drop it from ALLOWED"


@pytest.mark.parametrize(
    "source",
    [
        "import pytest\npytest.skip('no gpu')\n",
        "import pytest\n@pytest.mark.skip(reason='later')\ndef test_x(): pass\n",
        "import pytest, sys\n@pytest.mark.skipif(sys.platform != 'linux', reason='')\n"
        "def test_x(): pass\n",
        "import pytest\nyaml = pytest.importorskip('yaml')\n",
        "import pytest\npytestmark = pytest.mark.xfail\n",
        "from pytest import skip\nskip('x')\n",
        "from pytest import importorskip\n",
        "import unittest\n@unittest.skip('x')\ndef test_x(): pass\n",
        "import unittest\nclass T(unittest.TestCase):\n    def test_x(self): self.skipTest('x')\n",
        "import unittest\nraise unittest.SkipTest('x')\n",
    ],
)
def test_each_kind_of_skip_is_found(source: str) -> None:
    assert silent_skips(source), source


def test_require_comments_and_strings_are_not_skips() -> None:
    source = (
        "from rigs.prereq import require\n"
        "# pytest.skip('in a comment')\n"
        "def test_x():\n"
        "    '''pytest.mark.skipif in a docstring'''\n"
        "    require(True, 'pytest.skip in a message')\n"
    )
    assert silent_skips(source) == []
