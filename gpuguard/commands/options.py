"""What every command's arguments share: the checked argparse ``type=`` converters, the help
formatter, the flags several commands take, and ``Command``, what each ``<name>_args`` module
gives the CLI.

Every numeric and path argument is range-checked by a converter here, so NaN, infinities,
non-ASCII digits and out-of-range values are a usage error (exit 2, argparse's) and never reach a
command. Must stay cheap to import (standard library and ``gpuguard.core.pids`` only): the CLI
builds every command's parser for any command it runs.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from gpuguard.core.pids import PID_MAX_LIMIT

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``ArgumentParser.add_subparsers`` returns: each command adds its parser to it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One ``gpuguard`` subcommand as the CLI sees it: its name, the function that adds its
    parser (flags, help text) and the function that runs it, which imports the command's module
    only when called (``check-pod`` must not load the kube client, nor ``--help`` the demo)."""

    name: str
    add_parser: Callable[[Subparsers], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


_ASCII_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_ASCII_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
"""A plain non-negative decimal: ``float()`` also takes ``nan``, ``inf``, signs, spaces, ``_`` and
non-ASCII digits, none of which is a sane flag value."""


def bounded_int(name: str, low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type=``: ASCII digits only (``int()`` also takes ``١``, ``+1``, `` 1``,
    ``1_0``), ``low``..``high`` inclusive."""

    def convert(text: str) -> int:
        if _ASCII_DIGITS.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {name}: use ASCII digits only, {low} to {high}"
            )
        digits = text.lstrip("0") or "0"
        # Length first: int() of a string of more than 4300 digits raises.
        if len(digits) > len(str(high)) or not low <= int(digits) <= high:
            shown = text if len(text) <= 30 else f"{text[:30]}… ({len(text)} digits)"
            raise argparse.ArgumentTypeError(f"{name} {shown} is out of range ({low} to {high})")
        return int(digits)

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def seconds(high: float) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number of seconds, > 0 and ≤ ``high``."""

    def convert(text: str) -> float:
        value = float(text) if _ASCII_DECIMAL.fullmatch(text) else math.nan
        if not (math.isfinite(value) and 0 < value <= high):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration: use a number of seconds > 0 and ≤ {high:g}"
            )
        return value

    convert.__name__ = "seconds"
    return convert


def path(text: str) -> str:
    """An argparse ``type=`` for a file or directory: not empty (that used to mean "not given",
    silently), no NUL byte (``ValueError`` deep inside ``open``)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL byte")
    return text


def absolute_path(text: str) -> str:
    """``path``, made absolute against the working directory (``node.proc_root`` must be
    absolute in the config; a relative ``--proc-root`` on the command line is still natural)."""
    return os.path.abspath(path(text))


pid = bounded_int("PID", 1, PID_MAX_LIMIT)
port = bounded_int("port", 0, 65535)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Prose wrapped to the terminal, examples kept as written: a paragraph (text between blank
    lines) with an indented line is shown as it is (command lines, aligned columns); any other
    paragraph is filled to the help's width, as argparse's default formatter fills it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.strip("\n").split("\n\n")
        shown = []
        for paragraph in paragraphs:
            lines = paragraph.splitlines()
            if any(line[:1].isspace() for line in lines):
                shown.append("\n".join(indent + line for line in lines))
            else:
                shown.append(
                    textwrap.fill(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(shown) + "\n"


ROOT_NOTE = (
    "Run it as root: which process holds a GPU device file open is read from /proc/<pid>/fd, "
    "which for another user's process takes CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH. Root on the "
    "node has both; in the chart's enforcer container (CAP_KILL only) that is unknown, and taken "
    "as held, as the enforcer there takes it."
)
"""Why ``inspect`` and ``explain`` want root, for their epilogs."""


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The settings file and logging, for every command that loads the settings."""
    p.add_argument("--config", type=path, metavar="FILE", help="gpuguard config TOML")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["json", "console"])


def add_kubeconfig_flag(p: argparse.ArgumentParser) -> None:
    """The kubeconfig of a command that falls back to the in-cluster config."""
    p.add_argument("--kubeconfig", type=path, help="kubeconfig file (default: in-cluster config)")


def add_pod_directory_flags(p: argparse.ArgumentParser) -> None:
    """Where the read-only commands (``inspect``, ``explain``) find this node's pods."""
    add_kubeconfig_flag(p)
    p.add_argument("--node-name", help="this node's name (default $NODE_NAME)")
    p.add_argument(
        "--pods-file",
        type=path,
        metavar="FILE",
        help="read pods from a manifest file instead of the API server",
    )


def add_proc_root_flag(p: argparse.ArgumentParser) -> None:
    """The host's ``/proc`` of a read-only command (``inspect``, ``explain``)."""
    p.add_argument(
        "--proc-root", type=absolute_path, help="host /proc (default from config, /proc)"
    )


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """``--json`` of a command whose output is one JSON document (docs/design.md#cli-outputs)."""
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
