"""``gpuguard explain``'s arguments and help; the command is ``gpuguard.commands.explain``."""

from __future__ import annotations

import argparse

from gpuguard.commands.options import (
    ROOT_NOTE,
    Command,
    Formatter,
    Subparsers,
    add_config_flags,
    add_json_flag,
    add_pod_directory_flags,
    add_proc_root_flag,
    pid,
)
from gpuguard.core.pids import PID_MAX_LIMIT

NAME = "explain"

_EPILOG = f"""\
examples:
  kubectl -n gpuguard exec ds/gpuguard -c enforcer -- gpuguard explain 12345
  sudo gpuguard explain 12345 --json    one JSON document (docs/design.md#cli-outputs)
  sudo gpuguard explain 12345 --offline /proc only: no API server, no NVML

PID is a host PID, as NVML and nvidia-smi report it. Online, the pod comes from the API server
(or --pods-file) and the pod's GPU memory from NVML (without NVML it is null). {ROOT_NOTE}
"""


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``explain``'s parser: the PID, the output, and where the node's facts are."""
    p = sub.add_parser(
        NAME,
        help="why a PID is (not) attributed to a pod and (not) enforced",
        description=(
            "Show the PID's cgroup lines, the pod UID and container parsed from them, the runtime "
            "and cgroup version, and, online, the pod, its limit and the limit's source."
        ),
        epilog=_EPILOG,
        formatter_class=Formatter,
    )
    p.add_argument(
        "pid",
        type=pid,
        metavar="PID",
        help=f"host PID (as NVML reports it), 1 to {PID_MAX_LIMIT}",
    )
    add_proc_root_flag(p)
    p.add_argument(
        "--offline",
        action="store_true",
        help="skip the API server and NVML (the config is still read and checked)",
    )
    add_json_flag(p)
    add_pod_directory_flags(p)
    add_config_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Explain one PID; returns the exit code."""
    from gpuguard.commands.explain import run_explain_from_args

    return run_explain_from_args(args)


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
