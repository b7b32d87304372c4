"""Prometheus's tools for the tests that run them: ``promtool``, ``prometheus`` and
``alertmanager``, found through their ensure scripts, and a GET of their JSON API.

Owns: locating each tool (``$PROMETHEUS_DIR`` / ``$ALERTMANAGER_DIR`` when set, else the last
line ``scripts/ensure-<tool>.sh`` prints: built once from the Go module and cached, a hash and a
few ``--version`` calls when warm). A missing tool skips locally and fails in CI
(``rigs.prereq.require``). Must not start or stop anything: the tests own their processes
(``rigs.controlplane.terminate`` stops one by its PID).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

from rigs.prereq import require

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

PROMETHEUS = ("ensure-prometheus.sh", "PROMETHEUS_DIR")
"""Where ``prometheus`` and ``promtool`` come from: the ensure script, the variable naming
another directory."""
ALERTMANAGER = ("ensure-alertmanager.sh", "ALERTMANAGER_DIR")


@cache
def _tool_dir(script: str, env_var: str) -> tuple[Path | None, str]:
    """``(directory, "")`` or ``(None, why)``: ``$env_var`` if set, else the script's last
    line (a cold build takes minutes)."""
    given = os.environ.get(env_var)
    if given:
        return Path(given), ""
    done = subprocess.run(
        ["bash", str(SCRIPTS / script)], capture_output=True, text=True, check=False, timeout=1800
    )
    if done.returncode != 0:
        return None, f"{script} failed ({done.returncode}): {done.stderr[-2000:]}"
    lines = done.stdout.strip().splitlines()
    if not lines:
        return None, f"{script} printed no directory"
    return Path(lines[-1]), ""


def tool(binary: str, source: tuple[str, str] = PROMETHEUS) -> Path:
    """The executable ``binary`` from ``source`` (``PROMETHEUS`` or ``ALERTMANAGER``); skips
    (fails in CI) when it cannot be had, saying why."""
    script, env_var = source
    directory, why = _tool_dir(script, env_var)
    path = directory / binary if directory is not None else None
    if path is not None and not os.access(path, os.X_OK):
        why = f"{directory} has no executable {binary} ({env_var} or {script})"
    require(not why, why)
    assert path is not None
    return path


def get_json(url: str, **params: str) -> Any:
    """GET ``url`` (``params`` url-encoded as its query) and decode the JSON body."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)
