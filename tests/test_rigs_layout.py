"""No program or helper of the checkout edits Python's import path.

Why: the rigs the tests, the benchmarks and the scripts share were held together by
``sys.path`` edits (22 in 14 files): a benchmark put the repository first on its path to import
a test module, a script to import a benchmark's harness. They now share the ``rigs`` package,
the benchmarks and the scripts run as modules from the repository root (``python -m
benchmarks.scale``), and the import-linter contracts in ``pyproject.toml`` keep the directions.
An edit of the path would let an import around those contracts work again, so none is allowed.

The rule, read from every ``*.py`` of ``tests/``, ``benchmarks/``, ``scripts/`` and ``rigs/``
with ``ast``, and from every string in them that is a Python script (a ``python -c`` program, a
file a test writes and runs): no call that changes ``sys.path`` (``insert``, ``append``,
``extend``...), no assignment to it or to a slice of it, no ``del`` of a part of it, and no
``site.addsitedir``, under any name they were imported as. Reading the path is fine. A child
process that must import another source tree gets it from its environment (``PYTHONPATH``,
as ``benchmarks/violation_cost.py`` starts its worker), not by editing its own path.

Also here: a program run as a module records the command it was run with as such (the
provenance header's ``command``), not as the file ``sys.argv[0]`` then names.
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks", "scripts", "rigs")
MUTATORS = frozenset(
    {"insert", "append", "extend", "remove", "pop", "clear", "reverse", "sort", "__setitem__"}
)
"""The methods of a list that change it."""


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes; ``None`` for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _bound_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names ``tree`` reaches ``sys.path`` and ``site.addsitedir`` by, under whatever names
    it imported them (``import sys as s``: ``s.path``; ``from sys import path``: ``path``)."""
    paths, addsitedirs = {"sys.path"}, {"site.addsitedir"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sys":
                    paths.add(f"{alias.asname or 'sys'}.path")
                elif alias.name == "site":
                    addsitedirs.add(f"{alias.asname or 'site'}.addsitedir")
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "site"):
            for alias in node.names:
                if (node.module, alias.name) == ("sys", "path"):
                    paths.add(alias.asname or "path")
                elif (node.module, alias.name) == ("site", "addsitedir"):
                    addsitedirs.add(alias.asname or "addsitedir")
    return paths, addsitedirs


def _edits_in(tree: ast.AST) -> list[tuple[int, str]]:
    paths, addsitedirs = _bound_names(tree)

    def is_path(node: ast.AST) -> bool:
        return _dotted(node.value if isinstance(node, ast.Subscript) else node) in paths

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            changed = (
                func.value if isinstance(func, ast.Attribute) and func.attr in MUTATORS else None
            )
            if _dotted(func) in addsitedirs or (changed is not None and is_path(changed)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            if any(is_path(t) for t in targets):
                found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return found


def path_edits(source: str) -> list[str]:
    """``line: code`` of each edit of the import path in ``source`` and in the Python scripts
    written as its strings (``line`` the string's), in order."""
    tree = ast.parse(source)
    found = _edits_in(tree)
    data = {
        id(node)
        for definition in ast.walk(tree)
        if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for decorator in definition.decorator_list
        for node in ast.walk(decorator)
    }  # strings in decorators are data (this file's synthetic sources), not scripts
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in data:
            continue
        if "path" not in node.value and "addsitedir" not in node.value:
            continue
        try:
            script = ast.parse(textwrap.dedent(node.value))
        except SyntaxError:
            continue  # prose, a template: not a script
        found += [(node.lineno, f"in a script: {code}") for _, code in _edits_in(script)]
    return [f"{line}: {code}" for line, code in sorted(found)]


def scanned_files() -> list[Path]:
    return sorted(
        p
        for top in SCANNED
        for p in (ROOT / top).rglob("*.py")
        if "build" not in p.relative_to(ROOT).parts
    )


def test_no_module_of_the_tests_benchmarks_scripts_or_rigs_edits_the_import_path() -> None:
    files = scanned_files()
    assert len(files) > 100, f"only {len(files)} files under {SCANNED}: the scan would prove little"
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(SCANNED)
    edits = [
        f"{path.relative_to(ROOT)}:{edit}"
        for path in files
        for edit in path_edits(path.read_text(encoding="utf-8"))
    ]
    assert edits == [], (
        "import from the rigs package and run programs as modules from the repository root "
        "(python -m benchmarks.NAME); a child that needs another tree gets PYTHONPATH:\n"
        + "\n".join(edits)
    )


def test_the_benchmarks_and_the_scripts_are_packages_run_as_modules() -> None:
    for top in ("rigs", "benchmarks", "scripts"):
        assert (ROOT / top / "__init__.py").is_file(), f"{top}/ is no package"


@pytest.mark.parametrize(
    "source",
    [
        "import sys\nsys.path.insert(0, '/repo')",
        "import sys\nsys.path.append('/repo')",
        "import sys\nsys.path.extend(['/repo'])",
        "import sys\nsys.path[:0] = ['/src', '/repo']",
        "import sys\nsys.path = ['/repo', *sys.path]",
        "import sys\nsys.path += ['/repo']",
        "import sys\ndel sys.path[0]",
        "import sys as s\ns.path.insert(0, '/repo')",
        "from sys import path\npath.insert(0, '/repo')",
        "from sys import path as p\np[0:0] = ['/repo']",
        "import site\nsite.addsitedir('/repo')",
        "from site import addsitedir\naddsitedir('/repo')",
        "def f():\n    import sys\n    if '/r' not in sys.path:\n        sys.path.insert(0, '/r')",
        # Scripts written as strings: a python -c program, a file a test writes and runs.
        "SCRIPT = 'import sys\\nsys.path[:0] = [sys.argv[1]]\\nimport tests.fakes'",
        "def t(p):\n    p.write_text(textwrap.dedent('''\n        import sys\n"
        "        sys.path.insert(0, sys.argv[1])\n        '''))",
    ],
)
def test_the_check_finds_each_kind_of_path_edit(source: str) -> None:
    assert path_edits(source) != [], source


@pytest.mark.parametrize(
    "source",
    [
        "import sys\nprint(sys.path)",
        "import sys\nif '/repo' in sys.path: pass",
        "import sys\nfirst = list(sys.path)\nfirst.insert(0, '/x')",
        "import os\nenv = {**os.environ, 'PYTHONPATH': '/src'}",
        "parts = []\nparts.insert(0, 'x')\npath = ['a']\npath.append('b')",
        "S = 'sys.path.insert is banned here'",  # prose, not a script
        "from pathlib import Path\np = Path('x')\np.parent",
    ],
)
def test_the_check_passes_reads_of_the_path_and_other_lists(source: str) -> None:
    assert path_edits(source) == [], source


def test_a_recorded_command_names_the_module_a_program_was_run_as(tmp_path: Path) -> None:
    """The provenance header's ``command`` (``rigs.provenance``) of a program run as a module,
    whose ``sys.argv[0]`` is its file, is ``python -m NAME ARGS``, as the benchmarks and the
    scripts are now run; of a file run as one, the file as typed."""
    (tmp_path / "probe.py").write_text("from rigs.provenance import command\nprint(command())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    assert run("-m", "probe", "--trials", "3") == shlex.join(
        [sys.executable, "-m", "probe", "--trials", "3"]
    )
    assert run("probe.py", "--trials", "3") == shlex.join(
        [sys.executable, "probe.py", "--trials", "3"]
    )
