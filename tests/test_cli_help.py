"""Every command's arguments, pinned: each subcommand's parser (built by its own
``gpuguard/commands/<name>_args.py``) has exactly the flags below, in this order, each shown by
its ``--help``; every flag the docs show on a ``gpuguard <command>`` line is one that command
takes; and building the parser loads no command (``check-pod`` must not load the kube client,
nor ``--help`` the demo).

A builder that forgets, adds or reorders a flag fails here, and so does a doc that shows a flag
the command does not take.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuguard
from gpuguard.cli import build_parser

REPO = Path(__file__).resolve().parents[1]

_CONFIG = ("--config", "--log-level", "--log-format")
_POD_DIRECTORY = ("--kubeconfig", "--node-name", "--pods-file")

ARGUMENTS: dict[str, tuple[str, ...]] = {
    "enforce": (
        *_CONFIG,
        "--mode",
        "--node-name",
        "--proc-root",
        "--metrics-address",
        "--kubeconfig",
        "--pods-file",
    ),
    "agent": (*_CONFIG, "--node-name", "--metrics-address", "--kubeconfig", "--allow-eviction"),
    "inspect": (*_CONFIG, "--json", "--offline", "--proc-root", *_POD_DIRECTORY),
    "explain": ("PID", "--proc-root", "--offline", "--json", *_POD_DIRECTORY, *_CONFIG),
    "check-pod": ("FILE", "--config", "--gpu-memory", "--json"),
    "check-sharing": (
        "SHARING.yaml",
        "--device-plugin-config",
        "--mig-config",
        "--node",
        "--kubeconfig",
        "--cluster-nodes",
        "--json",
    ),
    "demo": ("--duration", "--json", "--metrics-port"),
}
"""Each command's positionals (by metavar) and flags, in the order its ``--help`` lists them
(``-h`` aside): docs/design.md#cli-outputs, README."""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _arguments(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The parser's positionals (by metavar) and long flags, in its help's order, ``-h`` aside."""
    shown: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            shown.extend(s for s in action.option_strings if s.startswith("--"))
        else:
            shown.append(str(action.metavar or action.dest))
    return tuple(shown)


def test_the_commands_are_these_in_this_order() -> None:
    assert list(_subcommands(build_parser())) == list(ARGUMENTS)


@pytest.mark.parametrize("command", list(ARGUMENTS))
def test_each_command_takes_exactly_its_documented_arguments_in_order(command: str) -> None:
    assert _arguments(_subcommands(build_parser())[command]) == ARGUMENTS[command]


@pytest.mark.parametrize("command", list(ARGUMENTS))
def test_each_commands_help_shows_every_argument_it_takes(command: str) -> None:
    text = _subcommands(build_parser())[command].format_help()
    usage, _, rest = text.partition("\n\n")
    for argument in ARGUMENTS[command]:
        assert argument in " ".join(usage.split()), (command, argument)
        assert re.search(rf"^\s+{re.escape(argument)}\b", rest, re.MULTILINE), (command, argument)


@pytest.mark.parametrize("columns", ["60", "72", "100", "200"])
def test_check_pod_help_teaches_dra_shares_and_keeps_its_examples_whole(
    columns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-pod's epilog: how a DRA share is found and rounded, when it is a limit,
    and that an annotation never raises it; the example command lines are kept as written at any
    width, the prose is filled to it."""
    monkeypatch.setenv("COLUMNS", columns)
    text = _subcommands(build_parser())["check-pod"].format_help()
    lines = text.splitlines()
    assert "  kubectl create deploy x --image=y --dry-run=client -o yaml |" in lines
    assert "    gpuguard check-pod - --gpu-memory 80Gi" in lines
    assert (
        "  gpuguard check-pod claim-templates.yaml pods.yaml --config config.toml --gpu-memory 80Gi"
    ) in lines
    prose = " ".join(text.split())
    for taught in (
        "ResourceClaimTemplates and ResourceClaims they name",
        "(spec.devices.requests[].exactly.capacity.requests.memory;",
        "rounded up to 1Mi as the scheduler accounts it: 1500M is held to 1431Mi",
        "A claim already allocated is held to its consumedCapacity.memory",
        "No memory request is the whole GPU (needs --gpu-memory)",
        "not in the files is named in a warning: no dra limit then",
        "only where the config's limits.sources lists dra (by default they are only shown)",
        "a pod's annotation never raises its share: the smaller binds",
    ):
        assert taught in prose, taught
    width = int(columns) - 2
    assert [line for line in lines if len(line) > width and not line[:1].isspace()] == []


def test_the_top_level_help_lists_every_command_with_its_summary() -> None:
    text = " ".join(build_parser().format_help().split())
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub._choices_actions:
        assert f"{choice.dest} {' '.join(str(choice.help).split())}" in text, choice.dest


_DOCUMENTED = re.compile(
    r"gpuguard (" + "|".join(map(re.escape, ARGUMENTS)) + r")\b([^`\n#|]*(?:\n  [^`\n#|]*)?)"
)
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def _documented_flags() -> dict[str, set[tuple[str, str]]]:
    """Command → (flag, file) for each flag on a ``gpuguard <command> ...`` line of README.md
    and docs/*.md (a bullet of docs/design.md#cli-outputs may go on to an indented line)."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for match in _DOCUMENTED.finditer(path.read_text()):
            for flag in _FLAG.findall(match.group(2)):
                found.setdefault(match.group(1), set()).add((flag, path.name))
    return found


def test_every_flag_the_docs_show_is_one_the_command_takes() -> None:
    documented = _documented_flags()
    # The extraction finds the docs' command lines: design.md's CLI outputs name these.
    assert {"--gpu-memory", "--cluster-nodes", "--metrics-port", "--offline"} <= {
        flag for flags in documented.values() for flag, _ in flags
    }
    wrong = sorted(
        (command, flag, where)
        for command, flags in documented.items()
        for flag, where in flags
        if flag not in ARGUMENTS[command] and flag != "--help"  # argparse gives each its --help
    )
    assert wrong == []


def test_building_the_parser_loads_no_command() -> None:
    code = (
        "import sys; from gpuguard.cli import build_parser; build_parser(); "
        "print(' '.join(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(done.stdout.split())
    heavy = {
        "gpuguard.app",
        "gpuguard.commands.demo",
        "gpuguard.commands.check_pod",
        "gpuguard.commands.check_sharing",
        "gpuguard.commands.explain",
        "gpuguard.commands.inspect",
        "gpuguard.config",
        "kubernetes",
        "rich",
        "yaml",
        "prometheus_client",
    }
    assert loaded & heavy == set()


def test_exit_codes_are_defined_once_for_every_command() -> None:
    """Every command returns the codes of ``gpuguard.commands.exit_codes``: a command that
    defines its own ``EXIT_*`` number can drift from the documented 0 / 1 / 2."""
    package = Path(gpuguard.__file__).parent
    own = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "exit_codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = [node.target] if isinstance(node, ast.AnnAssign) else []
            targets += node.targets if isinstance(node, ast.Assign) else []
            own += [
                f"{path.relative_to(package)}: {t.id}"
                for t in targets
                if isinstance(t, ast.Name) and t.id.startswith("EXIT_")
            ]
    assert own == []
