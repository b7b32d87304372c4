"""``gpuguard demo`` as a user runs it: a subprocess, its JSON lines, its metrics endpoint.

The demo's own exit code is its verdict (act one: the offender stopped within grace + 2 polls,
nobody else; act two: each simulated Node labelled by its first matching sharing rule, the MIG
change held until the Node is idle); these tests check that verdict is honest: read back from the
JSON summary and narration and from a live scrape of /metrics, /healthz and /readyz while it
runs. ``tests/test_sim_agent.py`` plays act two on a fake clock.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_demo_json_stops_the_offender_only_and_serves_metrics_while_running() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuguard.cli",
            "demo",
            "--duration",
            "12",
            "--json",
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    scraped: str | None = None
    health = ready = None
    try:
        # Until the demo exits (a loaded machine slows its start, so no fixed deadline under its
        # 12 s), with a bound in case it never does.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            try:
                code, body = _get(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                continue
            health = _get(f"http://127.0.0.1:{port}/healthz")[0]
            ready = _get(f"http://127.0.0.1:{port}/readyz")[0]
            if code == 200 and "gpuguard_kills_total 1.0" in body:
                scraped = body
                break
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    summary = lines[-1]
    assert summary["event"] == "demo_summary"
    assert summary["kills"] >= 1
    assert summary["wrong_kills"] == 0
    assert all(s["pid"] == 41001 for s in summary["signals"])
    assert summary["checks"]["protected_processes_alive"] is True
    # One pod declared KAI-style, one HAMi-style, each limited by its declaration (issue 15).
    assert summary["limits"]["ml-team/kai-finetune"] == {
        "limit_bytes": 12288 * 2**20,
        "source": "kai",
    }
    assert summary["limits"]["ml-team/hami-embedder"] == {
        "limit_bytes": 6144 * 2**20,
        "source": "hami",
    }
    assert summary["limits"]["ml-team/notebook-neighbour"]["source"] == "annotation"
    assert any(line["event"] == "container_signalled" for line in lines)
    assert scraped is not None, "never scraped gpuguard_kills_total 1 while the demo ran"
    for name in (
        "gpuguard_pod_gpu_memory_used_bytes",
        "gpuguard_pod_gpu_memory_limit_bytes",
        "gpuguard_gpu_memory_unattributed_bytes",
        "gpuguard_violations_total",
        "gpuguard_refusals_total",
        "gpuguard_poll_duration_seconds_bucket",
        "gpuguard_last_poll_timestamp_seconds",
        "gpuguard_enforcement_active",
    ):
        assert name in scraped, name
    assert 'namespace="ml-team",pod="notebook-neighbour"' in scraped
    assert "pid=" not in scraped
    assert health == 200
    assert ready == 200
    # Act two: the sharing agent on the simulated cluster.
    assert all(summary["checks"].values()), summary["checks"]
    agent = summary["agent"]
    assert agent["settled"] is True
    assert agent["seconds"] < 10
    dp, mig = "nvidia.com/device-plugin.config", "nvidia.com/mig.config"
    assert {n["name"]: (n["rule"], n["labels"]) for n in agent["nodes"]} == {
        "gpu-t4-1": ("t4-shared", {dp: "slice-4", mig: None}),
        "gpu-t4-2": ("t4-shared", {dp: "slice-4", mig: None}),
        "gpu-a100-1": ("a100-mig", {dp: "slice-2", mig: "all-1g.10gb"}),
    }
    [mig_write] = [w for w in agent["writes"] if mig in w["labels"]]
    assert mig_write["node"] == "gpu-a100-1"
    assert mig_write["gpu_pods"] == 0
    assert mig_write["mig_state"] not in ("pending", "rebooting")
    said = [line["text"] for line in lines if line["event"] == "demo_narration"]
    held = (
        "agent: gpu-a100-1 holds nvidia.com/mig.config=all-1g.10gb until 1 pod(s) holding a "
        "GPU finish"
    )
    applied = "agent: gpu-a100-1 applied nvidia.com/mig.config=all-1g.10gb (rule a100-mig)"
    assert held in said
    assert applied in said
    assert said.index(held) < said.index(applied)


def test_demo_too_short_to_see_the_kill_fails_honestly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuguard.cli", "demo", "--duration", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["event"] == "demo_summary"
    assert summary["kills"] == 0
    assert summary["passed"] is False
    assert summary["checks"]["offender_stopped"] is False
    # Act two does not depend on --duration: it still ran, and held.
    assert summary["checks"]["agent_labels_match_first_rule"] is True


def test_demo_rejects_a_busy_metrics_port_with_a_clear_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuguard.cli",
                "demo",
                "--duration",
                "1",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert f"--metrics-port {port}" in proc.stderr


def test_demo_rejects_out_of_range_ports_and_durations_as_usage_errors() -> None:
    # Each used to pass argparse: -1 and 70000 then died in bind() with an OverflowError
    # traceback (exit 1), nan ran a demo of no cycles and inf never ended.
    for flag, value in (
        ("--metrics-port", "-1"),
        ("--metrics-port", "70000"),
        ("--duration", "nan"),
        ("--duration", "inf"),
    ):
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "gpuguard.cli", "demo", "--json", f"{flag}={value}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            raise AssertionError(f"demo {flag}={value} was still running after 30 s") from None
        assert proc.returncode == 2, (flag, value, proc.stderr)
        assert f"argument {flag}" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""
