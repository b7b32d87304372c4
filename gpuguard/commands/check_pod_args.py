"""``gpuguard check-pod``'s arguments and help; the command is ``gpuguard.commands.check_pod``."""

from __future__ import annotations

import argparse
import sys

from gpuguard.commands.options import Command, Formatter, Subparsers, add_json_flag, path

NAME = "check-pod"

MAX_GPU_MEMORY_BYTES = 1 << 50
"""``--gpu-memory`` at most 1 PiB: any more is a typo, not a device (today's largest have a few
hundred GB), and quantities saturate at 2**63 - 1 rather than fail."""


def _gpu_memory(text: str) -> str:
    """An argparse ``type=`` for ``--gpu-memory``: a Kubernetes quantity of bytes, > 0 and ≤
    ``MAX_GPU_MEMORY_BYTES``. Returns the text: ``check-pod`` parses it itself."""
    from gpuguard.kubemodel.quantity import InvalidQuantity, parse_quantity_bytes

    try:
        value = parse_quantity_bytes(text)
    except InvalidQuantity as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value > MAX_GPU_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: a device's memory is at most 1Pi here"
        )
    return text


EPILOG = """examples:
  kubectl create deploy x --image=y --dry-run=client -o yaml |
    gpuguard check-pod - --gpu-memory 80Gi
  gpuguard check-pod claim-templates.yaml pods.yaml --config config.toml --gpu-memory 80Gi

DRA memory shares: a container that uses a claim (resources.claims) is held to the memory its \
device requests ask for (spec.devices.requests[].exactly.capacity.requests.memory; all of the \
claim's requests unless it names one), rounded up to 1Mi as the scheduler accounts it: 1500M \
is held to 1431Mi. A claim already allocated is held to its consumedCapacity.memory. No memory \
request is the whole GPU (needs --gpu-memory). Of firstAvailable subrequests the largest is \
shown. A claim or template the pod names that is not in the files is named in a warning: no \
dra limit then. The shares are a limit only where the config's limits.sources lists dra (by \
default they are only shown); a pod's annotation never raises its share: the smaller binds.
"""
"""What ``--help`` teaches after the options (wrapped to the terminal, examples as written)."""


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``check-pod``'s parser: the manifests, the config and the device's memory."""
    p = sub.add_parser(
        NAME,
        help="validate gpuguard annotations in pod manifests and show the resolved limits",
        description=(
            "Read manifests (multi-document YAML: Pods, Lists, and the pod templates of "
            "Deployments, StatefulSets, DaemonSets, ReplicaSets, ReplicationControllers, Jobs, "
            "CronJobs and PodTemplates, with the ResourceClaimTemplates and ResourceClaims they "
            "name), validate gpuguard.io/gpu-memory-limit and print each pod's effective limit "
            "and its source, and the DRA memory share each container would be held to. Exit 0 "
            "if every pod is valid, 1 if any has errors or the files hold nothing to check (or "
            "are not readable YAML), 2 on a usage or config error."
        ),
        epilog=EPILOG,
        formatter_class=Formatter,
    )
    p.add_argument(
        "files", nargs="+", type=path, metavar="FILE", help="manifest file(s); - reads stdin"
    )
    p.add_argument(
        "--config",
        type=path,
        metavar="FILE",
        help="gpuguard config TOML (namespace/cluster defaults, limits.sources)",
    )
    p.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        metavar="QUANTITY",
        help="the device's total memory, e.g. 80Gi (needed for percentages and for a DRA "
        "request without a memory amount: the whole GPU)",
    )
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the manifests; returns the exit code."""
    from gpuguard.commands.check_pod import run_check_pod

    return run_check_pod(
        files=args.files,
        config_path=args.config,
        gpu_memory=args.gpu_memory,
        as_json=args.json,
        stdout=sys.stdout,
    )


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
