"""``gpuguard demo``'s arguments and help; the command is ``gpuguard.commands.demo``.

``--duration``'s minimum comes from the demo's script (``demo.scenario``), read only when a
duration is given or the help is shown: importing the demo for every command's parser would cost
about 0.3 s.
"""

from __future__ import annotations

import argparse

from gpuguard.commands.options import Command, Subparsers, port, seconds

NAME = "demo"

MAX_DEMO_SECONDS = 86_400.0
"""``--duration`` at most a day: the scenario is over in seconds; longer only keeps serving. At
least ``gpuguard.commands.demo.scenario.minimum_duration_seconds()`` (``_duration``)."""


def _duration(text: str) -> float:
    """An argparse ``type=`` for ``--duration``: ``seconds``, and at least the demo's own minimum
    (any shorter and act one ends before it can show the kill, so the demo could only fail)."""
    value = seconds(MAX_DEMO_SECONDS)(text)
    from gpuguard.commands.demo import scenario

    minimum = scenario.minimum_duration_seconds()
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"{text} s is too short: use at least {minimum:g} s "
            f"({scenario.minimum_duration_reason()})"
        )
    return value


_duration.__name__ = "seconds"


class _HelpFormatter(argparse.HelpFormatter):
    """Fills ``%(minimum)s`` in the help with ``--duration``'s minimum, computed from the demo's
    script only when the help is shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text is None or "%(minimum)s" not in text:
            return text
        from gpuguard.commands.demo import scenario

        return text.replace("%(minimum)s", f"{scenario.minimum_duration_seconds():g}")


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """``demo``'s parser: how long act one runs, the output and the metrics port."""
    p = sub.add_parser(
        NAME,
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
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--duration",
        type=_duration,
        default=20.0,
        metavar="SECONDS",
        help=f"how long act one runs (default %(default)g; at least %(minimum)s, the time it needs "
        f"to show the kill; at most {MAX_DEMO_SECONDS:g}); act two adds a few seconds",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="structlog JSON lines; the last one is the demo_summary object",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        metavar="N",
        help="serve /metrics, /healthz, /readyz on 127.0.0.1:N while running (0: any free port)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Play both acts; returns the exit code (0 only if the demo's expectations held)."""
    from gpuguard.commands.demo import run_demo

    return run_demo(duration=args.duration, as_json=args.json, metrics_port=args.metrics_port)


COMMAND = Command(name=NAME, add_parser=add_parser, run=run)
