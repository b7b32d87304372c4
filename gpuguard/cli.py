"""The ``gpuguard`` command line: parses arguments and hands off to one command.

Owns argument parsing, ``--help`` text and exit codes, for every subcommand in this one place
(docs/design.md, CLI outputs): 0 success/valid; 1 invalid input or a failed check; 2 a usage error
(argparse, through the checked ``type=`` converters below: every numeric and path argument is
range-checked here, so NaN, infinities, non-ASCII digits and out-of-range values never reach a
command) or an invalid configuration (``ConfigError``, from any command). Must not contain command
logic: each subcommand lives in ``gpuguard.commands`` or ``gpuguard.app``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence

from gpuguard import __version__
from gpuguard.adapters.procfs import PID_MAX_LIMIT
from gpuguard.errors import ConfigError, PermanentError

EXIT_USAGE = 2
"""argparse's own exit code for a usage error; also every ``ConfigError``'s."""
EXIT_FAILED = 1
"""Invalid input or a failed check: a ``PermanentError`` that is not a config error."""

MAX_DEMO_SECONDS = 86_400.0
"""``demo --duration`` at most a day: the scenario is over in seconds; longer only keeps serving.
At least ``gpuguard.commands.demo.minimum_duration_seconds()`` (``_demo_duration``)."""
MAX_GPU_MEMORY_BYTES = 1 << 50
"""``check-pod --gpu-memory`` at most 1 PiB: any more is a typo, not a device (today's largest
have a few hundred GB), and quantities saturate at 2**63 - 1 rather than fail."""

_ASCII_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_ASCII_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
"""A plain non-negative decimal: ``float()`` also takes ``nan``, ``inf``, signs, spaces, ``_`` and
non-ASCII digits, none of which is a sane flag value."""


def _bounded_int(name: str, low: int, high: int) -> Callable[[str], int]:
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


def _seconds(high: float) -> Callable[[str], float]:
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


def _demo_duration(text: str) -> float:
    """An argparse ``type=`` for ``demo --duration``: ``_seconds``, and at least the demo's own
    minimum (any shorter and act one ends before it can show the kill, so the demo could only
    fail). The demo module is imported here, on use, not for every command's parser."""
    value = _seconds(MAX_DEMO_SECONDS)(text)
    from gpuguard.commands.demo import minimum_duration_reason, minimum_duration_seconds

    minimum = minimum_duration_seconds()
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"{text} s is too short: use at least {minimum:g} s ({minimum_duration_reason()})"
        )
    return value


_demo_duration.__name__ = "seconds"


class _DemoHelpFormatter(argparse.HelpFormatter):
    """Fills ``%(minimum)s`` in ``demo --help`` with ``--duration``'s minimum, computed from the
    demo's script only when the help is shown (importing the demo for every command's parser
    would cost about 0.3 s)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text is None or "%(minimum)s" not in text:
            return text
        from gpuguard.commands.demo import minimum_duration_seconds

        return text.replace("%(minimum)s", f"{minimum_duration_seconds():g}")


def _path(text: str) -> str:
    """An argparse ``type=`` for a file or directory: not empty (that used to mean "not given",
    silently), no NUL byte (``ValueError`` deep inside ``open``)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL byte")
    return text


def _absolute_path(text: str) -> str:
    """``_path``, made absolute against the working directory (``node.proc_root`` must be
    absolute in the config; a relative ``--proc-root`` on the command line is still natural)."""
    return os.path.abspath(_path(text))


def _gpu_memory(text: str) -> str:
    """An argparse ``type=`` for ``--gpu-memory``: a Kubernetes quantity of bytes, > 0 and ≤
    ``MAX_GPU_MEMORY_BYTES``. Returns the text: ``check-pod`` parses it itself."""
    from gpuguard.adapters.kube.quantity import InvalidQuantity, parse_quantity_bytes

    try:
        value = parse_quantity_bytes(text)
    except InvalidQuantity as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value > MAX_GPU_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: a device's memory is at most 1Pi here"
        )
    return text


_pid = _bounded_int("PID", 1, PID_MAX_LIMIT)
_port = _bounded_int("port", 0, 65535)


class _Formatter(argparse.RawDescriptionHelpFormatter):
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


_ROOT_NOTE = (
    "Run it as root: which process holds a GPU device file open is read from /proc/<pid>/fd, "
    "which for another user's process takes CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH. Root on the "
    "node has both; in the chart's enforcer container (CAP_KILL only) that is unknown, and taken "
    "as held, as the enforcer there takes it."
)

_INSPECT_EPILOG = f"""\
examples:
  kubectl -n gpuguard exec ds/gpuguard -c enforcer -- gpuguard inspect
  sudo gpuguard inspect --json          one JSON document: sample, devices, processes
  sudo gpuguard inspect --offline       pods by UID only: no API server

Needs NVML (libnvidia-ml.so.1, from the NVIDIA container runtime or the node's driver;
nvml.library_path or GPUGUARD_NVML_LIBRARY_PATH points at another one) and the host's /proc
(--proc-root, node.proc_root). {_ROOT_NOTE}
"""

_EXPLAIN_EPILOG = f"""\
examples:
  kubectl -n gpuguard exec ds/gpuguard -c enforcer -- gpuguard explain 12345
  sudo gpuguard explain 12345 --json    one JSON document (docs/design.md#cli-outputs)
  sudo gpuguard explain 12345 --offline /proc only: no API server, no NVML

PID is a host PID, as NVML and nvidia-smi report it. Online, the pod comes from the API server
(or --pods-file) and the pod's GPU memory from NVML (without NVML it is null). {_ROOT_NOTE}
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
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    enforce = sub.add_parser(
        "enforce",
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
        formatter_class=_Formatter,
    )
    _config_flags(enforce)
    enforce.add_argument(
        "--mode",
        choices=["enforce", "audit"],
        help="enforce: stop containers over their limit; audit: decide and log, never signal "
        "(enforcement.mode; default audit, unless the config or GPUGUARD_ENFORCEMENT_MODE says "
        "otherwise)",
    )
    enforce.add_argument("--node-name", help="this node's name (node.name; default $NODE_NAME)")
    enforce.add_argument(
        "--proc-root",
        type=_absolute_path,
        help="host /proc as mounted in the container (node.proc_root, e.g. /host/proc)",
    )
    enforce.add_argument("--metrics-address", help="host:port for /metrics, /healthz, /readyz")
    enforce.add_argument(
        "--kubeconfig", type=_path, help="kubeconfig file (default: in-cluster config)"
    )
    enforce.add_argument(
        "--pods-file",
        type=_path,
        metavar="FILE",
        help="read pods from a manifest file instead of the API server "
        "(GPU test runs without a cluster; Events become log lines)",
    )

    agent = sub.add_parser(
        "agent",
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
        formatter_class=_Formatter,
    )
    _config_flags(agent)
    agent.add_argument("--node-name", help="this node's name (node.name; default $NODE_NAME)")
    agent.add_argument(
        "--metrics-address",
        help="host:port for the agent's /metrics, /healthz, /readyz (agent.metrics_address)",
    )
    agent.add_argument(
        "--kubeconfig", type=_path, help="kubeconfig file (default: in-cluster config)"
    )
    agent.add_argument(
        "--allow-eviction",
        action="store_true",
        default=None,
        help="let migChangePolicy Drain evict GPU pods (agent.allow_eviction; needs the "
        "pods/eviction RBAC of manifests/agent-eviction-rbac.yaml)",
    )

    inspect = sub.add_parser(
        "inspect",
        help="one-shot table of every GPU process: pod, container, GPU, used, limit, verdict",
        description=(
            "Read NVML, /proc and the pod directory once and show what enforce would do: every "
            "GPU process with its pod, container, GPU (or MIG instance), used memory, the pod's "
            "limit there and its source, and a verdict. Reads only: signals and changes nothing."
        ),
        epilog=_INSPECT_EPILOG,
        formatter_class=_Formatter,
    )
    _config_flags(inspect)
    inspect.add_argument("--json", action="store_true", help="one JSON document on stdout")
    inspect.add_argument(
        "--offline",
        action="store_true",
        help="do not contact the API server (pods shown by UID only)",
    )
    inspect.add_argument(
        "--proc-root", type=_absolute_path, help="host /proc (default from config, /proc)"
    )
    _pod_directory_flags(inspect)

    explain = sub.add_parser(
        "explain",
        help="why a PID is (not) attributed to a pod and (not) enforced",
        description=(
            "Show the PID's cgroup lines, the pod UID and container parsed from them, the runtime "
            "and cgroup version, and, online, the pod, its limit and the limit's source."
        ),
        epilog=_EXPLAIN_EPILOG,
        formatter_class=_Formatter,
    )
    explain.add_argument(
        "pid",
        type=_pid,
        metavar="PID",
        help=f"host PID (as NVML reports it), 1 to {PID_MAX_LIMIT}",
    )
    explain.add_argument(
        "--proc-root", type=_absolute_path, help="host /proc (default from config, /proc)"
    )
    explain.add_argument(
        "--offline",
        action="store_true",
        help="skip the API server and NVML (the config is still read and checked)",
    )
    explain.add_argument("--json", action="store_true", help="one JSON document on stdout")
    _pod_directory_flags(explain)
    _config_flags(explain)

    check_pod = sub.add_parser(
        "check-pod",
        help="validate gpuguard annotations in pod manifests and show the resolved limits",
        description=(
            "Read manifests (multi-document YAML: Pods, Lists, and the pod templates of "
            "Deployments, StatefulSets, DaemonSets, ReplicaSets, ReplicationControllers, Jobs, "
            "CronJobs and PodTemplates), validate gpuguard.io/gpu-memory-limit and print each "
            "pod's effective limit and its source. Exit 0 if every pod is valid, 1 if any has "
            "errors or the files hold nothing to check (or are not readable YAML), 2 on a usage "
            "or config error."
        ),
        epilog="example:  kubectl create deploy x --image=y --dry-run=client -o yaml | "
        "gpuguard check-pod - --gpu-memory 80Gi",
    )
    check_pod.add_argument(
        "files", nargs="+", type=_path, metavar="FILE", help="manifest file(s); - reads stdin"
    )
    check_pod.add_argument(
        "--config", type=_path, help="gpuguard config TOML (namespace/cluster defaults)"
    )
    check_pod.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        metavar="QUANTITY",
        help="the device's total memory, e.g. 80Gi (needed for percentages)",
    )
    check_pod.add_argument("--json", action="store_true", help="one JSON document on stdout")

    check_sharing = sub.add_parser(
        "check-sharing",
        help="validate a sharing config (time-slicing and MIG profiles per node) before applying",
        description=(
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
        ),
        epilog="example:  gpuguard check-sharing sharing.yaml --kubeconfig ~/.kube/config "
        "--cluster-nodes   (offline: --device-plugin-config time-slicing-cm.yaml --mig-config "
        "mig-parted-cm.yaml --node node.yaml)",
    )
    check_sharing.add_argument(
        "sharing",
        type=_path,
        metavar="SHARING.yaml",
        help="the sharing config: ConfigMap gpuguard-sharing (key sharing.yaml) or the raw file",
    )
    check_sharing.add_argument(
        "--device-plugin-config",
        type=_path,
        metavar="FILE",
        help="the device plugin's ConfigMap (one profile per data key) or one raw config file "
        "(a profile named after the file, without .yaml)",
    )
    check_sharing.add_argument(
        "--mig-config",
        type=_path,
        metavar="FILE",
        help="mig-parted's ConfigMap (data key migConfig.key, default config.yaml) or raw config",
    )
    check_sharing.add_argument(
        "--node",
        type=_path,
        action="append",
        default=[],
        metavar="NODE.yaml",
        help="a Node manifest (or a List of Nodes) to match the rules against; repeatable",
    )
    check_sharing.add_argument(
        "--kubeconfig",
        type=_path,
        metavar="FILE",
        help="read the NVIDIA ConfigMaps the sharing config names from this cluster (only "
        "this flag: $KUBECONFIG and in-cluster config are never used implicitly)",
    )
    check_sharing.add_argument(
        "--cluster-nodes",
        action="store_true",
        help="with --kubeconfig: also match the rules against every Node of the cluster",
    )
    check_sharing.add_argument("--json", action="store_true", help="one JSON document on stdout")

    demo = sub.add_parser(
        "demo",
        help="run the real pipeline on a simulated node and watch a greedy pod being stopped, "
        "then the sharing agent label a simulated cluster",
        description=(
            "Act one, the enforcer: a simulated node with 2 GPUs: a pod that grows past its limit "
            "(stopped), its neighbour within its limit, a pod under a namespace default, an exempt "
            "pod over its limit and a host process (all must survive). Act two, the sharing "
            "agent: three simulated nodes get their time-slicing and MIG labels from a sharing "
            "config, and a MIG change waits until the node's training pod has finished. Exit 0 "
            "only if that is what happened."
        ),
        formatter_class=_DemoHelpFormatter,
    )
    demo.add_argument(
        "--duration",
        type=_demo_duration,
        default=20.0,
        metavar="SECONDS",
        help=f"how long act one runs (default %(default)g; at least %(minimum)s, the time it needs "
        f"to show the kill; at most {MAX_DEMO_SECONDS:g}); act two adds a few seconds",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="structlog JSON lines; the last one is the demo_summary object",
    )
    demo.add_argument(
        "--metrics-port",
        type=_port,
        metavar="N",
        help="serve /metrics, /healthz, /readyz on 127.0.0.1:N while running (0: any free port)",
    )
    return parser


def _pod_directory_flags(p: argparse.ArgumentParser) -> None:
    """Where the read-only commands (``inspect``, ``explain``) find this node's pods."""
    p.add_argument("--kubeconfig", type=_path, help="kubeconfig file (default: in-cluster config)")
    p.add_argument("--node-name", help="this node's name (default $NODE_NAME)")
    p.add_argument(
        "--pods-file",
        type=_path,
        metavar="FILE",
        help="read pods from a manifest file instead of the API server",
    )


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=_path, metavar="FILE", help="gpuguard config TOML")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["json", "console"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code. A usage error exits 2 inside ``parse_args``
    (argparse's ``SystemExit``), after one message on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, parser)
    except ConfigError as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PermanentError as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _demo(args: argparse.Namespace) -> int:
    from gpuguard.commands.demo import run_demo

    return run_demo(duration=args.duration, as_json=args.json, metrics_port=args.metrics_port)


def _check_pod(args: argparse.Namespace) -> int:
    from gpuguard.commands.check_pod import run_check_pod

    return run_check_pod(
        files=args.files,
        config_path=args.config,
        gpu_memory=args.gpu_memory,
        as_json=args.json,
        stdout=sys.stdout,
    )


def _check_sharing(args: argparse.Namespace) -> int:
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


def _explain(args: argparse.Namespace) -> int:
    from gpuguard.commands.explain import run_explain_from_args

    return run_explain_from_args(args)


def _inspect(args: argparse.Namespace) -> int:
    from gpuguard.commands.inspect import run_inspect_from_args

    return run_inspect_from_args(args)


def _enforce(args: argparse.Namespace) -> int:
    from gpuguard.app import run_enforce

    return run_enforce(args)


def _agent(args: argparse.Namespace) -> int:
    from gpuguard.app import run_agent

    return run_agent(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "check-pod": _check_pod,
    "check-sharing": _check_sharing,
    "explain": _explain,
    "inspect": _inspect,
    "enforce": _enforce,
    "agent": _agent,
}
"""Each subcommand's entry; imported on use, so ``check-pod`` does not load the kube client."""


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = _COMMANDS.get(args.command)
    if command is None:
        parser.error(f"unknown command {args.command}")  # exits 2
        raise AssertionError("unreachable")
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
