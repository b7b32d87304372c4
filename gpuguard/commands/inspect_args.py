"""``gpuguard inspect``'s arguments and help; the command is ``gpuguard.commands.inspect``."""

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
)

NAME = "inspect"

_EPILOG = f"""\
examples:
  kubectl -n gpuguard exec ds/gpuguard -c enforcer -- gpuguard inspect
  sudo gpuguard inspect --json          one JSON document: sample, devices, processes
  sudo gpuguard inspect --offline       pods by UID only: no API server

Needs NVML (libnvidia-ml.so.1, from the NVIDIA container runtime or the node's driver;
nvml.library_path or GPUGUARD_NVML_LIBRARY_PATH points at another one) and the host's /proc
(--proc-root, node.proc_root). {ROOT_NOTE}
"""


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``inspect``'s parser: the settings, the output, and where the node's facts are."""
    p = sub.add_parser(
        NAME,
        help="one-shot table of every GPU process: pod, container, GPU, used, limit, verdict",
        description=(
            "Read NVML, /proc and the pod directory once and show what enforce would do: every "
            "GPU process with its pod, container, GPU (or MIG instance), used memory, the pod's "
            "limit there and its source, and a verdict. Reads only: signals and changes nothing."
        ),
        epilog=_EPILOG,
        formatter_class=Formatter,
    )
    add_config_flags(p)
    add_json_flag(p)
    p.add_argument(
        "--offline",
        action="store_true",
        help="do not contact the API server (pods shown by UID only)",
    )
    add_proc_root_flag(p)
    add_pod_directory_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Gather once and show it; returns the exit code."""
    from gpuguard.commands.inspect import run_inspect_from_args

    return run_inspect_from_args(args)


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
