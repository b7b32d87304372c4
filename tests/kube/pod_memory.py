"""What a reader of a node's pods costs in memory, measured in a process of its own:
``python -m tests.kube.pod_memory --kubeconfig K --node N --reader directory|agent [--trace]``
prints one JSON object.

The reader is the production one (``KubePodDirectory``, the enforcer's; ``KubeSharingSource``,
the agent's, and its paged quorum read ``gpu_pods_now``), against the API server the kubeconfig
names, until its first list is in. Figures: ``rss_start_bytes`` (``VmRSS`` once everything is
imported, before the reader starts) and ``hwm_bytes`` (``VmHWM`` after it synced: the process's
peak, what a container's memory limit is held to). With ``--trace``, also ``traced_peak_bytes``
and ``traced_kept_bytes``: tracemalloc's peak while listing and what is still allocated after
(the reader's keep), both counted from the reader's start; tracemalloc's own tables inflate
``VmHWM``, so the two figures come from separate runs.

Used by ``tests/kube/test_fat_pods.py``; a helper module, not a test module.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuguard.adapters.kube import KubePodDirectory, load_api_client
from gpuguard.adapters.kube.agent import KubeSharingSource

SHARING_NS, SHARING_NAME = "gpuguard", "gpuguard-sharing"


def status_bytes(field: str) -> int:
    """A ``kB`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def measure(kubeconfig: str, node: str, reader: str, *, trace: bool) -> dict[str, Any]:
    api = load_api_client(kubeconfig)
    # One run on a node without pods first: the client's and the readers' lazy imports and
    # first-call setup (several MiB) are not what the node's pods cost.
    _run(api, node + "-empty", reader)
    gc.collect()
    result: dict[str, Any] = {"reader": reader, "rss_start_bytes": status_bytes("VmRSS")}
    if trace:
        tracemalloc.start()
    result.update(_run(api, node, reader, trace=trace))
    result["hwm_bytes"] = status_bytes("VmHWM")
    if trace:
        result["traced_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        kept = result.pop("kept")
        result["traced_kept_bytes"] = kept["bytes"]
        result["traced_kept_top"] = kept["top"]
        tracemalloc.stop()
    else:
        result.pop("kept")
    api.close()  # type: ignore[no-untyped-call]
    return result


def _run(api: Any, node: str, reader: str, *, trace: bool = False) -> dict[str, Any]:
    """The reader on ``node`` until synced: its pod counts and, tracing, what it keeps."""
    result: dict[str, Any] = {}
    if reader == "directory":
        directory = KubePodDirectory(api, node_name=node, watch_timeout_seconds=30)
        directory.start()
        try:
            if not directory.wait_synced(120):
                raise SystemExit(f"the directory did not sync: {directory.problem()}")
            result["pods"] = sum(1 for k, p in directory.snapshot().pods.items() if k == p.uid)
            result["kept"] = _traced(trace)
        finally:
            directory.stop()
    else:
        source = KubeSharingSource(
            api,
            node_name=node,
            sharing_namespace=SHARING_NS,
            sharing_name=SHARING_NAME,
            watch_timeout_seconds=30,
        )
        source.start()
        try:
            if not source.wait_synced(120):
                raise SystemExit(f"the agent's source did not sync: {source.problem()}")
            result["pods"] = len(source.inputs().gpu_pods)
            result["pods_now"] = len(source.gpu_pods_now())
            result["kept"] = _traced(trace)
        finally:
            source.stop()
    return result


def _traced(trace: bool) -> dict[str, Any] | None:
    """What the reader keeps once synced: allocated now, after a collection, and where the
    most of it was allocated (for a failing test's message)."""
    if not trace:
        return None
    gc.collect()
    top = tracemalloc.take_snapshot().statistics("lineno")[:8]
    return {
        "bytes": tracemalloc.get_traced_memory()[0],
        "top": [f"{s.size >> 10} KiB {s.traceback[0]}" for s in top],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--reader", choices=("directory", "agent"), required=True)
    p.add_argument("--trace", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.kubeconfig, args.node, args.reader, trace=args.trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
