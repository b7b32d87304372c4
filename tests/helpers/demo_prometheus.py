"""``gpuguard demo`` scraped by a real Prometheus: the run the alert and dashboard tests
evaluate their rules and queries over.

Owns the two processes (the demo with ``--json`` and its metrics port, Prometheus with a
one-second scrape and evaluation interval over the jobs it is given), their logs under the
work directory, and stopping both when the block ends, whatever happened. Must not wait for
or judge anything: each test waits for what it needs through the API.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from rigs.controlplane import free_port, terminate


@dataclass(frozen=True)
class DemoUnderPrometheus:
    """The running pair: the demo's process, Prometheus's HTTP API base and its log."""

    demo: subprocess.Popen[bytes]
    api: str
    log: Path
    demo_log: Path


def prometheus_config(
    jobs: Mapping[str, Sequence[str]], rule_files: Sequence[Path] = ()
) -> dict[str, object]:
    """Every ``job: [host:port, ...]`` scraped each second with its own labels kept, and the
    rules in ``rule_files`` evaluated each second."""
    config: dict[str, object] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "honor_labels": True, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
        ],
    }
    if rule_files:
        config["rule_files"] = [str(f) for f in rule_files]
    return config


@contextlib.contextmanager
def demo_under_prometheus(
    prometheus: Path,
    workdir: Path,
    *,
    demo_seconds: float,
    metrics_port: int,
    other_jobs: Mapping[str, Sequence[str]] | None = None,
    rule_files: Sequence[Path] = (),
) -> Iterator[DemoUnderPrometheus]:
    """Start ``gpuguard demo`` for ``demo_seconds`` serving /metrics on ``metrics_port``, and
    ``prometheus`` scraping it as job ``gpuguard`` (``other_jobs`` may add targets to it or
    name more jobs) with its database and logs in ``workdir``; stop both on leaving."""
    jobs: dict[str, list[str]] = {"gpuguard": [f"127.0.0.1:{metrics_port}"]}
    for job, targets in (other_jobs or {}).items():
        jobs.setdefault(job, []).extend(targets)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(jobs, rule_files)))
    web_port = free_port()
    demo_log, prom_log = workdir / "demo.log", workdir / "prom.log"
    with demo_log.open("wb") as demo_out, prom_log.open("wb") as prom_out:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gpuguard.cli", "demo", "--duration", f"{demo_seconds:g}",
             "--json", "--metrics-port", str(metrics_port)],
            stdout=demo_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        server = subprocess.Popen(
            [str(prometheus), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'db'}",
             f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=prom_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield DemoUnderPrometheus(
                demo=demo,
                api=f"http://127.0.0.1:{web_port}/api/v1",
                log=prom_log,
                demo_log=demo_log,
            )
        finally:
            terminate(server, timeout=10)
            terminate(demo, timeout=10)
