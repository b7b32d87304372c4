"""``gpuguard agent``'s arguments and help; the command itself is ``gpuguard.app.run_agent``
(the sharing agent's wiring lives in the app, which this layer sits above)."""

from __future__ import annotations

import argparse

from gpuguard.commands.options import (
    Command,
    Formatter,
    Subparsers,
    add_config_flags,
    add_kubeconfig_flag,
)

NAME = "agent"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``agent``'s parser: the settings file, this node, the API server and eviction."""
    p = sub.add_parser(
        NAME,
        help="run the sharing agent (the DaemonSet <release>-agent)",
        description=(
            "Keep this node's nvidia.com/device-plugin.config and nvidia.com/mig.config labels "
            "as the cluster sharing config (ConfigMap gpuguard-sharing, key sharing.yaml) says: "
            "the first rule that matches the Node wins. A MIG change waits for mig-manager to be "
            "idle and follows migChangePolicy (WhenIdle, Cordon, Drain, Force); an invalid new "
            "config is rejected whole and the last good one stays. Serves /metrics, /healthz "
            "and /readyz on agent.metrics_address. Validate a config first with "
            "'gpuguard check-sharing'. Settings: defaults < --config TOML < GPUGUARD_* env < flags."
        ),
        epilog="example:\n  gpuguard agent --node-name gpu-node-1 --kubeconfig ~/.kube/config",
        formatter_class=Formatter,
    )
    add_config_flags(p)
    p.add_argument("--node-name", help="this node's name (node.name; default $NODE_NAME)")
    p.add_argument(
        "--metrics-address",
        help="host:port for the agent's /metrics, /healthz, /readyz (agent.metrics_address)",
    )
    add_kubeconfig_flag(p)
    p.add_argument(
        "--allow-eviction",
        action="store_true",
        default=None,
        help="let migChangePolicy Drain evict GPU pods (agent.allow_eviction; needs the "
        "pods/eviction RBAC of manifests/agent-eviction-rbac.yaml)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Run the sharing agent until stopped; returns the exit code."""
    from gpuguard.app import run_agent

    return run_agent(args)


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
