"""``gpuguard check-sharing``'s arguments and help; the command is
``gpuguard.commands.check_sharing``."""

from __future__ import annotations

import argparse
import sys

from gpuguard.commands.options import Command, Subparsers, add_json_flag, path

NAME = "check-sharing"

_DESCRIPTION = (
    "Validate the gpuguard-sharing config (docs/design.md#sharing-config) and, with the "
    "NVIDIA configs, "
    "that every profile a rule names exists and is one NVIDIA's parsers accept; with "
    "--node, show per node the rule that matches and the labels it would get. Each FILE "
    "is a ConfigMap manifest or the raw config. With --kubeconfig, the NVIDIA "
    "ConfigMaps the sharing config names (those no FILE stands for) are read from that "
    "cluster, as the agent reads them: a missing one holds only the labels of the "
    "rules that need it (a warning per rule). Without FILEs or --kubeconfig the "
    "profile names are not checked (a warning says so). In --json, a label the rule "
    "leaves alone (or with no matching rule, an invalid sharing config, or held) is "
    "null. Exit 0 valid, 1 invalid (or an unreadable, hostile or wrongly shaped file), "
    "2 usage error (a file that cannot be opened, a cluster that cannot be read)."
)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``check-sharing``'s parser: the sharing config, NVIDIA's configs and the Nodes."""
    p = sub.add_parser(
        NAME,
        help="validate a sharing config (time-slicing and MIG profiles per node) before applying",
        description=_DESCRIPTION,
        epilog="example:  gpuguard check-sharing sharing.yaml --kubeconfig ~/.kube/config "
        "--cluster-nodes   (offline: --device-plugin-config time-slicing-cm.yaml --mig-config "
        "mig-parted-cm.yaml --node node.yaml)",
    )
    p.add_argument(
        "sharing",
        type=path,
        metavar="SHARING.yaml",
        help="the sharing config: ConfigMap gpuguard-sharing (key sharing.yaml) or the raw file",
    )
    p.add_argument(
        "--device-plugin-config",
        type=path,
        metavar="FILE",
        help="the device plugin's ConfigMap (one profile per data key) or one raw config file "
        "(a profile named after the file, without .yaml)",
    )
    p.add_argument(
        "--mig-config",
        type=path,
        metavar="FILE",
        help="mig-parted's ConfigMap (data key migConfig.key, default config.yaml) or raw config",
    )
    p.add_argument(
        "--node",
        type=path,
        action="append",
        default=[],
        metavar="NODE.yaml",
        help="a Node manifest (or a List of Nodes) to match the rules against; repeatable",
    )
    p.add_argument(
        "--kubeconfig",
        type=path,
        metavar="FILE",
        help="read the NVIDIA ConfigMaps the sharing config names from this cluster (only "
        "this flag: $KUBECONFIG and in-cluster config are never used implicitly)",
    )
    p.add_argument(
        "--cluster-nodes",
        action="store_true",
        help="with --kubeconfig: also match the rules against every Node of the cluster",
    )
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the sharing config; returns the exit code."""
    from gpuguard.commands.check_sharing import run_check_sharing

    return run_check_sharing(
        sharing_path=args.sharing,
        device_plugin_path=args.device_plugin_config,
        mig_path=args.mig_config,
        node_paths=args.node,
        as_json=args.json,
        stdout=sys.stdout,
        kubeconfig=args.kubeconfig,
        cluster_nodes=args.cluster_nodes,
    )


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
