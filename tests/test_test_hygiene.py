"""No test module is another's library: shared helpers live in named helper modules.

Why: tests imported other test modules' private helpers
(``from tests.test_alerts import _binary, _get, _stop``), so a helper's change broke a file
nobody looked at, and running one test file imported (and collected the fixtures of) another.
The rule, read from every ``tests/**/*.py`` and ``rigs/**/*.py`` with ``ast``: nothing imports a
``test_*`` module or a ``conftest`` (the integration tests took their rig from one), and nothing
reaches a ``_private`` name of another ``tests`` or ``rigs`` module, by ``from … import`` or as
an attribute of an imported one. Shared code goes into a helper module named for what it holds:
``tests/fakes.py``, ``tests/promtools.py``, ``tests/kube/agent_cluster.py``... for the tests
alone, the ``rigs`` package (``rigs/controlplane.py``, ``rigs/cgroups.py``...) for what the
benchmarks and the scripts share with them.

The same holds for scripts a test writes as a string and runs in a subprocess (``python -c``, a
file written then run): such a script that imports the test module that runs it (``from
tests.kernel.test_signals import observed``) runs that module as a library. In a script nothing
is exempt, the test's own module included. Strings in decorators are data, not scripts (this
file's synthetic sources, given through ``pytest.mark.parametrize``).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
RIGS = ROOT / "rigs"
SHARED_ROOTS = ("tests", "rigs")
"""The packages whose modules the rule covers: the tests and the rigs they share."""


def _is_test_module(dotted: str) -> bool:
    """A ``test_*`` module, or a ``conftest`` (fixtures: pytest loads it, nothing imports it)."""
    return any(part.startswith("test_") or part == "conftest" for part in dotted.split("."))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cross_imports(source: str, module: str) -> list[str]:
    """What ``source`` (the text of module ``module``, dotted) takes from other test modules
    that it must not: ``line: what``, in order."""
    found: list[str] = []
    aliases: dict[str, str] = {}
    """Local name → the ``tests`` or ``rigs`` module it is bound to (``from rigs import
    controlplane``)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in SHARED_ROOTS:
                    continue
                if _is_test_module(alias.name) and alias.name != module:
                    found.append(f"{node.lineno}: import {alias.name}")
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in SHARED_ROOTS or node.module == module:
                continue
            if _is_test_module(node.module):
                found.append(f"{node.lineno}: from {node.module} import …")
                continue
            for alias in node.names:
                if _is_test_module(alias.name) or _is_private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                else:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != module
            and _is_private(node.attr)
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


_SCRIPT_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?:tests|rigs)[.\s]|import[ \t]+(?:tests|rigs)\b)", re.MULTILINE
)
"""A line of a string that imports from ``tests`` or ``rigs``."""


def _import_statements(text: str) -> list[str]:
    """The ``tests`` and ``rigs`` imports of ``text``, each a statement of its own (an import in
    parentheses over several lines joined): for a string that is not Python as a whole (a
    template)."""
    statements: list[str] = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if not _SCRIPT_IMPORT.match(line):
            continue
        statement = line.strip()
        rest = iter(lines[n + 1 :])
        while "(" in statement and ")" not in statement and (more := next(rest, None)):
            statement += " " + more.strip()
        statements.append(statement)
    return statements


def script_imports(source: str) -> list[str]:
    """What the scripts written as string literals in ``source`` take from test modules: any
    import of a ``test_*`` module or of a ``tests`` or ``rigs`` module's ``_private`` name, with
    no exemption for the module ``source`` is (``line: in a script: what``, ``line`` the
    string's)."""
    tree = ast.parse(source)
    data = {
        id(node)
        for definition in ast.walk(tree)
        if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for decorator in definition.decorator_list
        for node in ast.walk(decorator)
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in data:
            continue
        if not _SCRIPT_IMPORT.search(node.value):
            continue
        script = textwrap.dedent(node.value)
        try:
            ast.parse(script)
            snippets = [script]
        except SyntaxError:
            snippets = _import_statements(script)
        for snippet in snippets:
            try:
                taken = cross_imports(snippet, "")
            except SyntaxError:
                taken = [f"?: {snippet} (not Python: cannot be checked)"]
            found += [f"{node.lineno}: in a script: {what.partition(': ')[2]}" for what in taken]
    return found


def _test_sources() -> list[Path]:
    """Every module of ``tests/`` (the stand-in's build folder aside) and of ``rigs/``."""
    tests = (p for p in TESTS.rglob("*.py") if "build" not in p.relative_to(TESTS).parts)
    return sorted([*tests, *RIGS.rglob("*.py")])


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_test_module_imports_another_or_its_private_names() -> None:
    sources = _test_sources()
    assert len(sources) > 50, sources  # the walk found the suite
    problems = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources
        for text in [path.read_text(encoding="utf-8")]
        for line in cross_imports(text, _dotted(path)) + script_imports(text)
    ]
    assert problems == [], "move these into a helper module:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "from tests.test_alerts import World",
        "from tests.test_alerts import _binary, _get, _stop",
        "from tests import test_dashboard",
        "import tests.kube.test_agent",
        "import tests.kube.test_agent as agent_tests",
        "from tests.integration.conftest import GIB, Rig",
        "from tests.integration import conftest",
        "def f():\n    from tests.kube.test_chart_install import is_ready",
        "from tests.apiserver import _cert",
        "from tests import apiserver\napiserver._terminate(p)",
        "import tests.apiserver as a\na._tail(log)",
        "from rigs.controlplane import _wait_ok",
        "from rigs import controlplane\ncontrolplane._wait_running(p, log, 1)",
        "import rigs.node as node\nnode._running(1)",
    ],
)
def test_the_check_finds_each_kind_of_cross_import(source: str) -> None:
    assert cross_imports(source, "tests.test_something_else") != []


@pytest.mark.parametrize(
    "source",
    [
        "from tests.fakes import FakeClock, gpu",
        "from tests.apiserver import terminate\nterminate(p)",
        "from tests import apiserver\napiserver.terminate(p)",
        "from rigs import controlplane\ncontrolplane.terminate(p)",
        "from rigs.cgroups import CgroupTree",
        "from tests.kube.agent_cluster import running_agent",
        "from gpuguard.adapters.metrics.server import _MAX_WORKERS",  # the product's own rules
        "from tests.test_something_else import helper",  # itself (a subprocess re-importing it)
        "import os\nos._exit(0)",
        "from tests.fakes import FakeClock\nFakeClock.__name__",
    ],
)
def test_the_check_passes_helper_modules_and_the_product(source: str) -> None:
    assert cross_imports(source, "tests.test_something_else") == []


@pytest.mark.parametrize(
    "source",
    [
        # The two scripts this check was written for, as they were.
        'SCRIPT = """\nimport json\nfrom tests.kernel.test_signals import observed\n"""',
        "def test_x(tmp_path):\n    (tmp_path / 's.py').write_text(textwrap.dedent(\n"
        '        """\n        import sys\n        from tests.test_fault_rows import (\n'
        '            _HangingResolver, _fast_enforcer,\n        )\n        """))',
        # Inline, private names of helper modules, attributes, a template that is not Python.
        "subprocess.run([sys.executable, '-c', 'import tests.kube.test_agent'])",
        "run('from tests.apiserver import _cert; print(_cert())')",
        "S = 'from tests import apiserver\\napiserver._terminate(p)'",
        "S = 'from rigs.cgroups import _procs_of'",
        "S = 'import os\\nfrom tests.test_alerts import World\\nx = {'",
        "S = 'from tests.fakes import (\\n    _hidden,\\n)\\nx = {'",
    ],
)
def test_the_script_check_finds_test_modules_and_private_names_imported_in_strings(
    source: str,
) -> None:
    found = script_imports(source)
    assert found != []
    assert all(": in a script: " in line for line in found), found


@pytest.mark.parametrize(
    "source",
    [
        "S = 'from rigs.kill_targets import observed, target_for'",
        "S = 'import json, sys\\nfrom tests.stuck_reads import HangingResolver, run_for'",
        "S = 'from gpuguard.adapters.metrics.server import _MAX_WORKERS'",  # the product's own
        "S = 'Shared code goes into a helper module (``from tests import apiserver``).'",  # prose
        '@pytest.mark.parametrize("s", ["from tests.test_alerts import _get"])\ndef test_x(s): ...',
        "S = 'from tests.fakes import (\\n    FakeClock,\\n)\\nx = {'",
    ],
)
def test_the_script_check_passes_helper_modules_prose_and_synthetic_sources(source: str) -> None:
    assert script_imports(source) == []


MAX_MODULE_LINES = 600
"""A module of gpuguard/ over this many lines says why in its docstring."""


def oversized_without_a_reason(root: Path) -> list[str]:
    """Modules of ``root/gpuguard`` over ``MAX_MODULE_LINES`` whose docstring has no
    ``Size:`` paragraph saying why they stay whole."""
    found = []
    for path in sorted((root / "gpuguard").rglob("*.py")):
        source = path.read_text()
        if source.count("\n") <= MAX_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if not re.search(r"^Size: \S", doc, re.MULTILINE):
            found.append(str(path.relative_to(root)))
    return found


def test_every_long_module_says_why_it_stays_whole() -> None:
    assert oversized_without_a_reason(ROOT) == []


def test_the_size_check_finds_a_long_module_with_no_reason(tmp_path: Path) -> None:
    (tmp_path / "gpuguard").mkdir()
    body = "x = 1\n" * (MAX_MODULE_LINES + 1)
    (tmp_path / "gpuguard" / "long.py").write_text('"""A module."""\n' + body)
    (tmp_path / "gpuguard" / "why.py").write_text(
        '"""A module.\n\nSize: one state machine.\n"""\n' + body
    )
    (tmp_path / "gpuguard" / "short.py").write_text('"""A module."""\nx = 1\n')
    assert oversized_without_a_reason(tmp_path) == ["gpuguard/long.py"]


MAX_FUNCTION_LINES = 60
"""No function of gpuguard/ has a body (its docstring not counted) over this many lines."""


def long_functions(root: Path) -> list[str]:
    """``path:function lines`` for each function of ``root/gpuguard`` whose body, without its
    docstring, runs over ``MAX_FUNCTION_LINES``."""
    found = []
    for path in sorted((root / "gpuguard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if len(body) > 1 and ast.get_docstring(node) is not None:
                body = body[1:]
            lines = (node.end_lineno or body[-1].lineno) - body[0].lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(root)}:{node.name} {lines}")
    return found


def test_no_function_is_over_60_lines() -> None:
    assert long_functions(ROOT) == []


def test_the_length_check_finds_a_long_function_and_skips_its_docstring(tmp_path: Path) -> None:
    (tmp_path / "gpuguard").mkdir()
    doc = '    """' + "\n" * 30 + '    """\n'
    fits = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "gpuguard" / "m.py").write_text(
        f"def fits():\n{doc}{fits}\n\nasync def long():\n{fits}    return 1\n"
    )
    assert long_functions(tmp_path) == [f"gpuguard/m.py:long {MAX_FUNCTION_LINES + 1}"]


def _fixture_name(node: ast.stmt) -> str | None:
    """The fixture name a module-level function declares (``@pytest.fixture``, ``name=``)."""
    if not isinstance(node, ast.FunctionDef):
        return None
    for deco in node.decorator_list:
        call = deco if isinstance(deco, ast.Call) else None
        target = call.func if call is not None else deco
        if getattr(target, "attr", getattr(target, "id", "")) != "fixture":
            continue
        for kw in call.keywords if call is not None else ():
            if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                return str(kw.value.value)
        return node.name
    return None


def shadowed_fixtures(sources: dict[str, str]) -> list[str]:
    """``module: imported name -> fixture`` where a test module imports a helper's fixture and
    defines its own of the same fixture name: pytest then keeps one of the two (by attribute
    order), so a local override, parametrized or not, may silently never run. ``sources``:
    dotted module name → source text."""
    helpers: dict[tuple[str, str], str] = {}
    for module, text in sources.items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and (name := _fixture_name(node)) is not None:
                helpers[(module, node.name)] = name
    found = []
    for module, text in sources.items():
        if not _is_test_module(module):
            continue
        tree = ast.parse(text)
        local = {n for node in tree.body if (n := _fixture_name(node)) is not None}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    name = helpers.get((node.module, alias.name))
                    if name is not None and name in local:
                        found.append(f"{module}: {alias.name} -> {name}")
    return found


def test_no_test_module_shadows_a_fixture_it_imports() -> None:
    sources = {_dotted(p): p.read_text() for p in _test_sources()}
    assert shadowed_fixtures(sources) == []


def test_the_shadow_check_finds_a_local_fixture_named_like_an_imported_one() -> None:
    helper = (
        '@pytest.fixture(name="make_source")\ndef make_source_fixture() -> int:\n    return 1\n'
    )
    test = (
        "from tests.helper import make_source_fixture\n"
        '@pytest.fixture(name="make_source", params=[1, 2])\n'
        "def both(request) -> int:\n    return request.param\n"
    )
    clean = "from tests.helper import make_source_fixture\ndef test_x(make_source): ...\n"
    assert shadowed_fixtures({"tests.helper": helper, "tests.test_x": test}) == [
        "tests.test_x: make_source_fixture -> make_source"
    ]
    assert shadowed_fixtures({"tests.helper": helper, "tests.test_x": clean}) == []
