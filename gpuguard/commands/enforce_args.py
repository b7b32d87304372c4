"""``gpuguard enforce``'s arguments and help; the command itself is ``gpuguard.app.run_enforce``
(the enforcer's wiring lives in the app, which this layer sits above)."""

from __future__ import annotations

import argparse

from gpuguard.commands.options import (
    Command,
    Formatter,
    Subparsers,
    absolute_path,
    add_config_flags,
    add_kubeconfig_flag,
    path,
)

NAME = "enforce"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``enforce``'s parser: the settings file, the mode and where this node's facts are."""
    p = sub.add_parser(
        NAME,
        help="run the node enforcer (the DaemonSet's main container)",
        description=(
            "Poll NVML, attribute each GPU process to its pod through /proc/<pid>/cgroup, compare "
            "each pod's memory per GPU with its limit and stop offenders: a Warning Event, then "
            "SIGTERM after the grace period, then SIGKILL. In audit mode (the default) it decides "
            "the same and sends nothing. Serves /metrics, /healthz and /readyz. Needs NVML, the "
            "host PID namespace and CAP_KILL, as the chart's DaemonSet gives it; outside the host "
            "PID namespace it runs and refuses every signal. Settings: defaults < --config TOML "
            "< GPUGUARD_* env < flags.\n\n"
            "Design and contracts: docs/design.md#enforcement-cycle."
        ),
        epilog="example:\n  gpuguard enforce --config /etc/gpuguard/config.toml --mode audit",
        formatter_class=Formatter,
    )
    add_config_flags(p)
    p.add_argument(
        "--mode",
        choices=["enforce", "audit"],
        help="enforce: stop containers over their limit; audit: decide and log, never signal "
        "(enforcement.mode; default audit, unless the config or GPUGUARD_ENFORCEMENT_MODE says "
        "otherwise)",
    )
    p.add_argument("--node-name", help="this node's name (node.name; default $NODE_NAME)")
    p.add_argument(
        "--proc-root",
        type=absolute_path,
        help="host /proc as mounted in the container (node.proc_root, e.g. /host/proc)",
    )
    p.add_argument("--metrics-address", help="host:port for /metrics, /healthz, /readyz")
    add_kubeconfig_flag(p)
    p.add_argument(
        "--pods-file",
        type=path,
        metavar="FILE",
        help="read pods from a manifest file instead of the API server "
        "(GPU test runs without a cluster; Events become log lines)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Run the enforcer until stopped; returns the exit code."""
    from gpuguard.app import run_enforce

    return run_enforce(args)


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
