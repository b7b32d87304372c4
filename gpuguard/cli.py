"""The ``gpuguard`` command line: parses arguments and hands off to one command.

Owns the top-level parser, the order of the subcommands and the exit codes (docs/design.md, CLI
outputs): 0 success/valid; 1 invalid input or a failed check; 2 a usage error (argparse, through
the checked ``type=`` converters of ``gpuguard.commands.options``: every numeric and path argument
is range-checked there, so NaN, infinities, non-ASCII digits and out-of-range values never reach a
command) or an invalid configuration (``ConfigError``, from any command). Each subcommand's flags
and help live beside it, in ``gpuguard.commands.<name>_args``; each runs in ``gpuguard.commands``
or ``gpuguard.app``, imported only when it runs. Must not contain command logic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpuguard import __version__
from gpuguard.commands import (
    agent_args,
    check_pod_args,
    check_sharing_args,
    demo_args,
    enforce_args,
    explain_args,
    inspect_args,
)
from gpuguard.commands.exit_codes import EXIT_FAILED, EXIT_USAGE
from gpuguard.commands.options import Command, Formatter
from gpuguard.core.text import printable
from gpuguard.errors import ConfigError, PermanentError

COMMANDS: tuple[Command, ...] = (
    enforce_args.COMMAND,
    agent_args.COMMAND,
    inspect_args.COMMAND,
    explain_args.COMMAND,
    check_pod_args.COMMAND,
    check_sharing_args.COMMAND,
    demo_args.COMMAND,
)
"""Every subcommand, in the order ``--help`` lists them."""

_EPILOG = """\
examples:
  gpuguard demo                         watch a simulated node stop a greedy pod (no GPU needed)
  gpuguard enforce --config /etc/gpuguard/config.toml
  gpuguard agent --config /etc/gpuguard/config.toml
  gpuguard check-sharing sharing.yaml --device-plugin-config dp.yaml --mig-config mig.yaml
  gpuguard inspect                      every GPU process with pod, limit and verdict
  gpuguard explain 12345                why PID 12345 is (not) attributed and enforced
  gpuguard check-pod pod.yaml --gpu-memory 80Gi

the pod annotation:
  gpuguard.io/gpu-memory-limit: "8Gi"   (or "25%" of the device's memory)

Docs: README.md and docs/ in the source tree; the design and every output's contract in
docs/design.md.
"""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description=(
            "Make time-sliced NVIDIA GPUs safe to share: per-pod GPU memory limits, enforced by "
            "stopping the offending container (SIGTERM, grace, SIGKILL), with Events and metrics."
        ),
        epilog=_EPILOG,
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code. A usage error exits 2 inside ``parse_args``
    (argparse's ``SystemExit``), after one message on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, parser)
    except ConfigError as exc:
        _error(exc)
        return EXIT_USAGE
    except PermanentError as exc:
        _error(exc)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _error(exc: PermanentError) -> None:
    """The one message of an error that stops a command, escaped here whoever raised it: its text
    may quote what others wrote (a file name, a library's message about a file's contents) that
    its raiser did not escape. Its own line breaks stay (a config error lists one problem a
    line)."""
    print(f"gpuguard: {printable(str(exc), line_breaks=True)}", file=sys.stderr)


_RUN = {command.name: command.run for command in COMMANDS}


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    run = _RUN.get(args.command)
    if run is None:
        parser.error(f"unknown command {args.command}")  # exits 2
        raise AssertionError("unreachable")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
