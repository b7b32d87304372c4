"""The demo's live view: act one's table (a row per pod and GPU), act two's (a row per Node),
each above the narration's last lines, redrawn in place while the act plays; then the verdict
in words. Shown only without ``--json``."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from rich.console import RenderableType

from gpuguard.commands.demo.grid import Grid
from gpuguard.commands.demo.narration import Feed, who
from gpuguard.commands.demo.scenario import GRACE_SECONDS, Scenario
from gpuguard.core.policy import Decision, PodUsage, UsageState
from gpuguard.core.reconcile import MIG_CONFIG_STATE_LABEL
from gpuguard.core.sharing import DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL
from gpuguard.sim.node import GiB

if TYPE_CHECKING:
    from rich.live import Live

    from gpuguard.commands.demo.enforcer_act import Seen
    from gpuguard.commands.demo.sharing_act import SharingAct
    from gpuguard.commands.demo.verdict import Verdict


def _used_of_limit(used_bytes: int | None, limit_bytes: int | None) -> str:
    """``used / limit`` in GiB (the column header names the unit), ``-`` for unknown."""
    return " / ".join("-" if n is None else f"{n / GiB:.1f}" for n in (used_bytes, limit_bytes))


_STATE_STYLES = {
    UsageState.OK: "green",
    UsageState.OVER: "bold red",
    UsageState.STOPPING: "bold yellow",
    UsageState.EXEMPT: "cyan",
}


def node_table(
    decision: Decision | None, elapsed: float, duration: float, feed: Feed, seen: Seen
) -> RenderableType:
    """Act one's live view: a row per pod and GPU, then one per GPU for memory no pod holds. A
    pod whose processes are gone keeps its row with what it used when it was stopped (or when
    last seen), never a row of "-"."""
    from rich.console import Group
    from rich.panel import Panel

    rows: list[tuple[tuple[int, str], tuple[str, ...]]] = []
    shown: set[tuple[str, int]] = set()
    for u in decision.usages if decision is not None else ():
        key = (who(u.pod), u.device.index)
        shown.add(key)
        style = _STATE_STYLES.get(u.state)
        state = f"[{style}]{u.state.value}[/]" if style else u.state.value
        rows.append(((u.device.index, key[0]), _pod_cells(key, u, u.used_bytes, state)))
    for key in sorted({*seen.usages, *seen.stops} - shown):
        last, stop = seen.usages.get(key), seen.stops.get(key)
        if stop is not None:
            cells = _pod_cells(
                key,
                last,
                stop.used_bytes,
                f"[bold yellow]stopped ({stop.signal.value})[/]",
                limit_bytes=stop.limit_bytes,
            )
        else:
            assert last is not None
            cells = _pod_cells(key, last, last.used_bytes, "[dim]gone (last seen)[/]")
        rows.append(((key[1], key[0]), cells))
    rows.sort(key=lambda r: r[0])
    grid_rows = [cells for _, cells in rows]
    unattributed = decision.unattributed_bytes if decision is not None else {}
    devices = decision.devices if decision is not None else ()
    for device, n in sorted(unattributed.items(), key=lambda kv: kv[0].uuid):
        if n:
            idx = next((str(d.index) for d in devices if d.key == device), "?")
            grid_rows.append(
                (
                    "[dim](no pod: host or unattributed)[/]",
                    idx,
                    _used_of_limit(n, None),
                    "-",
                    "[dim]never signalled[/]",
                )
            )
    table = Grid(
        title=f"gpuguard demo — act one: the enforcer on a simulated node, "
        f"t={elapsed:5.2f}s / {duration:g}s",
        headers=("pod", "GPU", "used / limit GiB", "source", "state"),
        rows=grid_rows,
        right=frozenset({2}),
    )
    return Group(table, Panel("\n".join(feed.lines) or "no action yet", title="actions"))


def _pod_cells(
    key: tuple[str, int],
    usage: PodUsage | None,
    used_bytes: int,
    state: str,
    *,
    limit_bytes: int | None = None,
) -> tuple[str, ...]:
    limit = usage.limit if usage is not None else None
    if limit_bytes is None and limit is not None:
        limit_bytes = limit.limit_bytes
    source = limit.source.value if limit is not None and limit.source is not None else "-"
    return (key[0], str(key[1]), _used_of_limit(used_bytes, limit_bytes), source, state)


def cluster_table(act: SharingAct) -> RenderableType:
    """Act two's live view: a row per Node. Its title's time is the actions' own clock
    (``SharingAct.now()``, the demo's), not the act's: "t= 3.3s" above actions stamped 15 s
    told two stories."""
    from rich.console import Group
    from rich.panel import Panel

    rows: list[tuple[str, ...]] = []
    for name, node in act.nodes.items():
        labels = act.cluster.labels(name)
        report = node.last
        waiting = report.decision.waiting if report and report.decision else None
        if waiting is not None:
            agent = f"[bold yellow]waiting: {waiting.value}[/]"
        elif report is not None and report.patched is not None:
            agent = "[cyan]writing[/]"
        else:
            agent = "[green]in sync[/]"
        mig, state = labels.get(MIG_CONFIG_LABEL, "-"), labels.get(MIG_CONFIG_STATE_LABEL)
        rows.append(
            (
                name,
                (report.rule or "-") if report is not None else "-",
                labels.get(DEVICE_PLUGIN_CONFIG_LABEL, "-"),
                mig if state is None else f"{mig} ({state})",
                str(len(act.cluster.gpu_pods(name))),
                agent,
            )
        )
    table = Grid(
        title=f"gpuguard demo — act two: the sharing agent on {len(act.nodes)} simulated "
        f"nodes, t={act.now():5.2f}s",
        headers=("node", "rule", "device-plugin config", "mig config (state)", "GPU pods", "agent"),
        rows=rows,
    )
    return Group(table, Panel("\n".join(act.feed.lines) or "no action yet", title="actions"))


def live_view(out: TextIO) -> Live:
    """A live display on ``out``, started: ``update()`` redraws it, ``stop()`` leaves it."""
    from rich.console import Console
    from rich.live import Live

    view = Live(console=Console(file=out), refresh_per_second=8, transient=False)
    view.start()
    return view


def print_verdict(verdict: Verdict, scenario: Scenario, act: SharingAct, *, out: TextIO) -> None:
    """The verdict in words: PASS or FAIL, act one's timing, who survived, each Node's labels and
    every check."""
    from rich.console import Console

    shown = "[bold green]PASS[/]" if verdict.passed else "[bold red]FAIL[/]"
    console = Console(file=out)
    console.print(f"\n{shown}  kills={verdict.kills} wrong_kills={verdict.wrong_kills}")
    if verdict.latency_seconds is not None:
        console.print(
            f"offender crossed its limit at {verdict.crossing_seconds:.2f}s, first SIGTERM "
            f"{verdict.latency_seconds:.2f}s later (budget: grace {GRACE_SECONDS}s + 2 polls = "
            f"{verdict.budget_seconds:.2f}s)"
        )
    for pid, name in scenario.protected.items():
        alive = scenario.node.process(pid).alive
        console.print(f"  {'✓' if alive else '✗'} {name}: {'alive' if alive else 'KILLED'}")
    for name in act.nodes:
        labels = ", ".join(f"{k}={v}" for k, v in act.final_labels(name).items() if v)
        console.print(f"  {name}: {labels or 'no sharing labels'}")
    for name, passed in verdict.checks.items():
        console.print(f"  {'✓' if passed else '✗'} {name}")
