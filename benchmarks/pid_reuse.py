"""Repeat the forced-PID-reuse race many times and print how often a wrong signal got through.

Runs the driver of ``tests/kernel/test_pid_reuse.py`` in a fresh PID namespace
(``unshare --pid --fork --mount-proc``; needs root and a writable cgroup v2 hierarchy). Each
trial kills a victim, forces the kernel to hand its PID to a bystander through
``ns_last_pid``, then tries to signal the dead victim by its observation through
``PidfdKiller.signal_members`` (the per-member path of ``signal_container``) and, with the
bystander in another pod, ``signal_container`` itself. "wrong signals" counts bystanders that
received anything: it must be 0.

    .venv/bin/python -m benchmarks.pid_reuse --trials 1000
    .venv/bin/python -m benchmarks.pid_reuse --trials 1000 --mode stamp   # observed at once
    .venv/bin/python -m benchmarks.pid_reuse --trials 1000 --mode bare    # the known limit
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

from rigs.pid_reuse import MODES, run_in_new_pid_namespace
from rigs.provenance import header, header_lines

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=1000, help="per variant")
    parser.add_argument("--variants", default="other,same")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="wait",
        help="wait: observe the victim a tick after its start; stamp: at once, with its "
        "boot_ticks stamp; bare: at once, with a forged later stamp (measures the limit of a "
        "starttime check)",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = parser.parse_args()
    variants = args.variants.split(",")
    rows = []
    for variant in variants:
        summary = run_in_new_pid_namespace(
            trials=args.trials,
            variants=[variant],
            timeout_seconds=3600,
            mode=args.mode,
        )
        summary.pop("results")
        summary["variant"] = variant
        rows.append(summary)
    if args.json:
        print(json.dumps({"provenance": header(), "variants": rows}, indent=2))
    else:
        print("\n".join(header_lines()))
        print(
            f"# {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')} {platform.node()} "
            f"kernel {platform.release()} python {platform.python_version()} "
            f"mode={args.mode}"
        )
        print(
            "| R's cgroup | trials | reuse achieved | wrong signals | refused identity_changed "
            "| container-path deliveries | stale pidfd ESRCH | same-tick reuses | seconds |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            where = "other pod's container" if r["variant"] == "other" else "victim's container"
            print(
                f"| {where} | {r['trials']} | {r['reuse_achieved']} | {r['wrong_signals']} "
                f"| {r['refused_identity_changed']} | {r['container_deliveries']} "
                f"| {r['stale_pidfd_esrch']} | {r['same_tick_reuses']} | {r['seconds']} |"
            )
    return 1 if any(r["wrong_signals"] for r in rows) and args.mode != "bare" else 0


if __name__ == "__main__":
    sys.exit(main())
