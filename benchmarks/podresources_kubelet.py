"""A stand-in kubelet for the benchmarks: ``rigs/podresources.py``'s real gRPC
``v1.PodResourcesLister`` server, in a process of its own, answering ``List`` with the pods of a
JSON file until it is sent SIGTERM.

Its own process so that the kubelet's CPU is never counted as gpuguard's: a benchmark times
its own process (``time.process_time``), and the reader's calls cross a real unix socket as
they do on a node.

The file is a list of pods: ``{"namespace", "name", "containers": [{"name", "devices":
[[resource, [ID, ...]], ...]}]}``. Run: ``python -m benchmarks.podresources_kubelet SOCKET
PODS_JSON`` from the repository root.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from rigs.podresources import KubeletServer, answer, container, pod


def kubelet_answer(pods: list[dict[str, Any]]) -> Any:
    """The ``ListPodResourcesResponse`` of ``pods`` (as the file lists them)."""
    return answer(
        *(
            pod(
                p["namespace"],
                p["name"],
                [
                    container(c["name"], [(r, ids) for r, ids in c["devices"]])
                    for c in p["containers"]
                ],
            )
            for p in pods
        )
    )


def main() -> int:
    socket, pods_json = Path(sys.argv[1]), Path(sys.argv[2])
    server = KubeletServer(socket)
    server.answer = kubelet_answer(json.loads(pods_json.read_text()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    server.start()
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
