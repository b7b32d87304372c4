"""Pods files for the tests of ``FilePodDirectory`` (tests/test_podfile.py,
tests/test_podfile_notices.py): pods, a pods list, and an atomic write with a fresh mtime."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

UID_A = "11111111-1111-1111-1111-111111111111"
UID_B = "22222222-2222-2222-2222-222222222222"


def pod(uid: str, name: str, *, node: str = "node-1", limit: str = "8Gi") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "uid": uid,
            "name": name,
            "namespace": "ml",
            "annotations": {"gpuguard.io/gpu-memory-limit": limit},
        },
        "spec": {"nodeName": node},
    }


_stamp = [1_700_000_000_000_000_000]


def write(path: Path, data: str | bytes) -> None:
    """Replace the file at once (the watcher never sees it half written) with a new mtime: two
    writes within one timestamp tick would look unchanged."""
    if isinstance(data, str):
        data = data.encode()
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    _stamp[0] += 1_000_000_000
    os.utime(new, ns=(_stamp[0], _stamp[0]))
    new.replace(path)


def pods_list(*pods: dict[str, Any]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(pods)})
