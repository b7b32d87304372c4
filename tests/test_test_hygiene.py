"""No test module is another's library: shared helpers live in named helper modules.

Why (issue 27): tests imported other test modules' private helpers
(``from tests.test_alerts import _binary, _get, _stop``), so a helper's change broke a file
nobody looked at, and running one test file imported (and collected the fixtures of) another.
The rule, read from every ``tests/**/*.py`` with ``ast``: nothing imports a ``test_*`` module,
and nothing reaches a ``_private`` name of another ``tests`` module, by ``from … import`` or as
an attribute of an imported one. Shared code goes into a helper module named for what it holds
(``tests/fakes.py``, ``tests/promtools.py``, ``tests/chart_release.py``,
``tests/kube/agent_cluster.py``...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cross_imports(source: str, module: str) -> list[str]:
    """What ``source`` (the text of module ``module``, dotted) takes from other test modules
    that it must not: ``line: what``, in order."""
    found: list[str] = []
    aliases: dict[str, str] = {}
    """Local name → the ``tests`` module it is bound to (``from tests import apiserver``)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tests":
                    continue
                if _is_test_module(alias.name) and alias.name != module:
                    found.append(f"{node.lineno}: import {alias.name}")
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "tests" or node.module == module:
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


def _test_sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "build" not in p.relative_to(TESTS).parts)


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_test_module_imports_another_or_its_private_names() -> None:
    sources = _test_sources()
    assert len(sources) > 50, sources  # the walk found the suite
    problems = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources
        for line in cross_imports(path.read_text(encoding="utf-8"), _dotted(path))
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
        "def f():\n    from tests.kube.test_chart_install import is_ready",
        "from tests.apiserver import _cert",
        "from tests import apiserver\napiserver._terminate(p)",
        "import tests.apiserver as a\na._tail(log)",
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
        "from tests.kube.agent_cluster import running_agent",
        "from gpuguard.adapters.metrics.server import _MAX_WORKERS",  # the product's own rules
        "from tests.test_something_else import helper",  # itself (a subprocess re-importing it)
        "import os\nos._exit(0)",
        "from tests.fakes import FakeClock\nFakeClock.__name__",
    ],
)
def test_the_check_passes_helper_modules_and_the_product(source: str) -> None:
    assert cross_imports(source, "tests.test_something_else") == []
