"""The ``gpuguard`` command line: parses arguments and hands off to one command.

Owns argument parsing, ``--help`` text and exit codes (0 success/valid, 1 invalid input or a
failed check, 2 usage error). Must not contain command logic: each subcommand lives in
``gpuguard.commands`` or ``gpuguard.app``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpuguard import __version__
from gpuguard.errors import ConfigError, PermanentError

_EPILOG = """\
examples:
  gpuguard demo                         watch a simulated node stop a greedy pod (no GPU needed)
  gpuguard enforce --config /etc/gpuguard/config.toml
  gpuguard inspect                      every GPU process with pod, limit and verdict
  gpuguard explain 12345                why PID 12345 is (not) attributed and enforced
  gpuguard check-pod pod.yaml --gpu-memory 80Gi

The pod annotation:  gpuguard.io/gpu-memory-limit: "8Gi"   (or "25%" of the device's memory)
Docs: README.md and docs/ in the source tree.
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    enforce = sub.add_parser(
        "enforce",
        help="run the node enforcer (the DaemonSet's main container)",
        description=(
            "Poll NVML, attribute each GPU process to its pod through /proc/<pid>/cgroup, compare "
            "each pod's memory per GPU with its limit and stop offenders. Serves /metrics, "
            "/healthz and /readyz. Settings: defaults < --config TOML < GPUGUARD_* env < flags."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_flags(enforce)
    enforce.add_argument(
        "--mode",
        choices=["enforce", "audit"],
        help="audit: decide and log, never signal (enforcement.mode)",
    )
    enforce.add_argument("--node-name", help="this node's name (node.name; default $NODE_NAME)")
    enforce.add_argument(
        "--proc-root",
        help="host /proc as mounted in the container (node.proc_root, e.g. /host/proc)",
    )
    enforce.add_argument("--metrics-address", help="host:port for /metrics, /healthz, /readyz")
    enforce.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    enforce.add_argument(
        "--pods-file",
        metavar="FILE",
        help="read pods from a manifest file instead of the API server "
        "(GPU test runs without a cluster; Events become log lines)",
    )

    inspect = sub.add_parser(
        "inspect",
        help="one-shot table of every GPU process: pod, container, GPU, used, limit, verdict",
        description="Read NVML, /proc and the pod directory once and show what enforce would do.",
    )
    _config_flags(inspect)
    inspect.add_argument("--json", action="store_true", help="one JSON document on stdout")
    inspect.add_argument(
        "--offline",
        action="store_true",
        help="do not contact the API server (pods shown by UID only)",
    )
    inspect.add_argument("--proc-root", help="host /proc (default from config, /proc)")
    inspect.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    inspect.add_argument("--node-name", help="this node's name (default $NODE_NAME)")
    inspect.add_argument(
        "--pods-file",
        metavar="FILE",
        help="read pods from a manifest file instead of the API server",
    )

    explain = sub.add_parser(
        "explain",
        help="why a PID is (not) attributed to a pod and (not) enforced",
        description=(
            "Show the PID's cgroup lines, the pod UID and container parsed from them, the runtime "
            "and cgroup version, and, online, the pod, its limit and the limit's source."
        ),
    )
    explain.add_argument("pid", type=int, metavar="PID", help="host PID (as NVML reports it)")
    explain.add_argument("--proc-root", default="/proc", help="host /proc (default /proc)")
    explain.add_argument("--offline", action="store_true", help="skip the API server")
    explain.add_argument("--json", action="store_true", help="one JSON document on stdout")
    explain.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    explain.add_argument("--node-name", help="this node's name (default $NODE_NAME)")
    explain.add_argument(
        "--pods-file",
        metavar="FILE",
        help="read pods from a manifest file instead of the API server",
    )
    _config_flags(explain)

    check_pod = sub.add_parser(
        "check-pod",
        help="validate gpuguard annotations in pod manifests and show the resolved limits",
        description=(
            "Read Pod manifests (multi-document YAML), validate gpuguard.io/gpu-memory-limit and "
            "print each pod's effective limit and its source. Exit 1 if any pod has errors."
        ),
    )
    check_pod.add_argument("files", nargs="+", metavar="FILE", help="pod manifest(s)")
    check_pod.add_argument("--config", help="gpuguard config TOML (namespace/cluster defaults)")
    check_pod.add_argument(
        "--gpu-memory",
        metavar="QUANTITY",
        help="the device's total memory, e.g. 80Gi (needed for percentages)",
    )
    check_pod.add_argument("--json", action="store_true", help="one JSON document on stdout")

    demo = sub.add_parser(
        "demo",
        help="run the real pipeline on a simulated node and watch a greedy pod being stopped",
        description=(
            "A simulated node with 2 GPUs: a pod that grows past its limit (stopped), its "
            "neighbour within its limit, a pod under a namespace default, an exempt pod over its "
            "limit and a host process (all must survive). Exit 0 only if that is what happened."
        ),
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="how long to run (default 20; at least 10 to see the kill)",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="structlog JSON lines; the last one is the demo_summary object",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve /metrics, /healthz, /readyz on 127.0.0.1:N while running",
    )
    return parser


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="gpuguard config TOML")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["json", "console"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, parser)
    except ConfigError as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return 2 if args.command in ("enforce", "inspect") else 1
    except PermanentError as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "demo":
        from gpuguard.commands.demo import run_demo

        if args.duration <= 0:
            parser.error("--duration must be > 0 seconds")
        return run_demo(duration=args.duration, as_json=args.json, metrics_port=args.metrics_port)
    if args.command == "check-pod":
        from gpuguard.commands.check_pod import run_check_pod

        return run_check_pod(
            files=args.files,
            config_path=args.config,
            gpu_memory=args.gpu_memory,
            as_json=args.json,
            stdout=sys.stdout,
        )
    if args.command == "explain":
        from gpuguard.commands.explain import run_explain_from_args

        return run_explain_from_args(args)
    if args.command == "inspect":
        from gpuguard.commands.inspect import run_inspect_from_args

        return run_inspect_from_args(args)
    if args.command == "enforce":
        from gpuguard.app import run_enforce

        return run_enforce(args)
    parser.error(f"unknown command {args.command}")  # exits 2
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
