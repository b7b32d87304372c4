"""Config values gpuguard refuses: one list, two readers. tests/test_config.py feeds each to the
loader as a config file; tests/test_chart.py renders each as the Helm value ``config`` and expects
helm to refuse it (a value gpuguard refuses must fail ``helm install``, not every
enforcer at start on every node).

A case is a config (nested tables, as the TOML file and the Helm value hold them) with exactly one
problem, what gpuguard's message starts with (``names``) and says (``reason``). ``chart`` is set
where the chart refuses the value in the words of its JSON schema (a wrong JSON type, a string
outside a closed set): those are helm's, gpuguard's are the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True, slots=True, kw_only=True)
class BadConfig:
    config: dict[str, Any]
    """Tables of config.toml without ``version``: what the case sets."""
    names: str
    """How gpuguard's problem starts, after the file's path: ``limits.default = ``."""
    reason: str
    """Part of gpuguard's problem: what is wrong or what is allowed."""
    chart: str | None = None
    """Part of helm's schema error, where the schema refuses the value before gpuguard's check
    can (helm then names the value's place, ``at '/config/limits/default'``)."""

    @property
    def key(self) -> str:
        """The dotted key the case is about (the first one set)."""
        dotted, table = [], self.config
        while isinstance(table, dict) and table:
            name = next(iter(table))
            dotted.append(name)
            table = table[name]
        return ".".join(dotted)

    @property
    def id(self) -> str:
        return f"{self.key}={_shown(_leaf(self.config))}"

    def toml(self) -> str:
        """The config file: ``version = 1`` and the case's tables."""
        lines = ["version = 1"]
        _tables(self.config, [], lines)
        return "\n".join(lines) + "\n"


def bad(
    key: str, value: object, reason: str, *, names: str | None = None, chart: str | None = None
) -> BadConfig:
    """One key (dotted) set to ``value``."""
    *path, leaf = key.split(".")
    config: dict[str, Any] = {leaf: value}
    for name in reversed(path):
        config = {name: config}
    return BadConfig(config=config, names=names or f"{key} = ", reason=reason, chart=chart)


BAD_CONFIGS: Final = [
    # [enforcement]
    bad("enforcement.poll_interval_seconds", 0, "must be a number > 0 (seconds)"),
    bad("enforcement.poll_interval_seconds", "fast", "must be a number > 0 (seconds)",
        chart="got string, want number"),
    bad("enforcement.grace_seconds", -1, "must be a number ≥ 0 (seconds)"),
    bad("enforcement.grace_seconds", True, "must be a number ≥ 0 (seconds)",
        chart="got boolean, want number"),
    bad("enforcement.grace_seconds", math.nan, "must be a number ≥ 0 (seconds)"),
    bad("enforcement.grace_seconds", math.inf, "must be a number ≥ 0 (seconds)"),
    bad("enforcement.use_cgroup_kill", "yes", "must be true or false",
        chart="got string, want boolean"),
    bad("enforcement.mode", "Enforce", 'must be one of "enforce", "audit"'),
    bad("enforcement.mode", "kill", 'must be one of "enforce", "audit"'),
    bad("enforcement.fast_interval_seconds", 2.0,
        "must not exceed enforcement.poll_interval_seconds (1, from default)"),
    bad("enforcement.fast_interval_seconds", -0.1, "must be a number ≥ 0 (seconds)"),
    bad("enforcement.fast_interval_seconds", "fast", "must be a number ≥ 0 (seconds)",
        chart="got string, want number"),
    bad("enforcement.pressure_free_fraction", 1.5, "must be a number from 0 to 1 (a fraction)"),
    bad("enforcement.pressure_free_fraction", -0.01, "must be a number from 0 to 1 (a fraction)"),
    bad("enforcement.fast_step_bytes", "64MB", "has an unknown unit (did you mean 64Mi or 64M?)"),
    BadConfig(
        config={"enforcement": {"staleness_seconds": 24, "poll_interval_seconds": 12}},
        names="enforcement.staleness_seconds = 24: ",
        reason="must be more than twice enforcement.poll_interval_seconds (24, from ",
    ),
    BadConfig(
        config={"enforcement": {"staleness_seconds": 4}, "kube": {"watch_timeout_seconds": 3}},
        names="enforcement.staleness_seconds = 4: ",
        reason="must be more than nvml.call_timeout_seconds (5, from default)",
    ),
    BadConfig(
        config={"enforcement": {"staleness_seconds": 25}, "kube": {"watch_timeout_seconds": 30}},
        names="enforcement.staleness_seconds = 25: ",
        reason="must be more than kube.watch_timeout_seconds (30, from ",
    ),
    # [node], [metrics]
    bad("node.proc_root", "host/proc", "must be an absolute path"),
    bad("node.name", "Node_1", "must be a Kubernetes node name"),
    bad("metrics.address", "9410", 'must be "host:port"'),
    bad("metrics.address", "host:99999", 'must be "host:port"'),
    bad("metrics.address", "::1:9410", "IPv6 hosts go in brackets"),
    # [limits]
    bad("limits.default", "0", "is zero"),
    bad("limits.default", "101%", "out of range"),
    bad("limits.default", 1.5, "must be a quantity string",
        chart="--set-string config.limits.default=16Gi"),
    bad("limits.default", "8GB", "has an unknown unit (did you mean 8Gi or 8G?)"),
    bad("limits.default", "16GB", "has an unknown unit (did you mean 16Gi or 16G?)"),
    # Nothing below 1 MiB is a limit: a cluster default of 16 bytes would stop
    # every unannotated GPU pod.
    bad("limits.default", 16, "below the smallest limit of 1Mi",
        chart="--set-string config.limits.default=16Gi"),
    bad("limits.default", "16", "did you mean 16Gi?"),
    bad("limits.default", "1023Ki", "below the smallest limit of 1Mi"),
    bad("limits.default", "0.0000000001%", "below the smallest limit of 1Mi"),
    bad("limits.default", "1" + "0" * 70, "longer than 64 characters"),
    bad("limits.replicas_reserve_bytes", "-1Gi", "is negative"),
    bad("limits.replicas_reserve_bytes", "10%", "is a percentage, not allowed here"),
    bad("limits.exempt_namespaces", ["ok", "Not OK"], 'not valid: "Not OK"'),
    bad("limits.exempt_namespaces", "kube-system", "must be a list of namespace names",
        chart="got string, want array"),
    bad("limits.exempt_namespace_label", "gpuguard.io/exempt", "one namespace label as key=value"),
    bad("limits.exempt_namespace_label", "gpuguard.io/exempt==true", "as key=value"),
    bad("limits.exempt_namespace_label", "Bad_Prefix/exempt=true", "as key=value"),
    bad("limits.exempt_namespace_label", "a/" + "x" * 64 + "=true", "as key=value"),
    # A prefix of four 63-character DNS labels: each label valid, the prefix over 253.
    bad("limits.exempt_namespace_label", ".".join(["a" * 63] * 4) + "/x=true", "as key=value"),
    bad("limits.exempt_namespace_label", ["gpuguard.io/exempt=true"], "as key=value",
        chart="got array, want string"),
    bad("limits.sources", ["gpuguard", "kai", "kai"], "listed twice: kai"),
    bad("limits.sources", ["gpuguard", "runai"], 'unknown: "runai"',
        chart="value must be one of 'gpuguard', 'kai', 'hami', 'gpushare', 'volcano'"),
    bad("limits.sources", [], '(default ["gpuguard"])'),
    bad("limits.sources", "kai", "must be a list", chart="got string, want array"),
    # [limits.namespaces.<namespace>]
    bad("limits.namespaces.ml.default", "512Ki", "below the smallest limit of 1Mi"),
    bad("limits.namespaces.ml.max", "512Ki", "below the smallest limit of 1Mi"),
    bad("limits.namespaces.Team_A.default", "1Gi", "'Team_A' is not a namespace name",
        names="[limits.namespaces.Team_A]: "),
    BadConfig(
        config={"limits": {"namespaces": {"team-b": {"default": "20Gi", "max": "10Gi"}}}},
        names="limits.namespaces.team-b.default is above limits.namespaces.team-b.max",
        reason="the default would always be capped",
    ),
    # [agent]
    bad("agent.sharing_namespace", "GPU_Guard", "must be a namespace name (lower-case DNS label"),
    bad("agent.sharing_namespace", "gpuguard.io", "must be a namespace name"),
    bad("agent.sharing_namespace", "a" * 64, "≤ 63 characters"),
    bad("agent.sharing_namespace", "", 'e.g. "gpuguard"'),
    bad("agent.sharing_name", "Sharing", "must be a ConfigMap name (lower-case DNS subdomain"),
    bad("agent.sharing_name", "-sharing", 'e.g. "gpuguard-sharing"'),
    bad("agent.sharing_name", 1, "must be a ConfigMap name"),
    bad("agent.allow_eviction", "true", "must be true or false"),
    bad("agent.keep_cordon_on_failure", 1, "must be true or false",
        chart="got number, want boolean"),
    bad("agent.metrics_address", "9411", 'no ":port"; must be "host:port"'),
    bad("agent.metrics_address", "0.0.0.0:65536", "not a whole number from 0 to 65535"),
    bad("agent.interval_seconds", 0.04, "must be a number from 0.05 to 60 (seconds)"),
    bad("agent.interval_seconds", 0, "must be a number from 0.05 to 60 (seconds)"),
    bad("agent.interval_seconds", 60.5, "must be a number from 0.05 to 60 (seconds)"),
    bad("agent.interval_seconds", math.inf, "must be a number from 0.05 to 60 (seconds)"),
    bad("agent.interval_seconds", "1s", "must be a number from 0.05 to 60 (seconds)",
        chart="got string, want number"),
    bad("agent.min_write_interval_seconds", -0.1, "must be a number from 0 to 60 (seconds)"),
    bad("agent.min_write_interval_seconds", 61, "must be a number from 0 to 60 (seconds)"),
    bad("agent.min_write_interval_seconds", math.nan, "must be a number from 0 to 60 (seconds)"),
    # [kube], [nvml], [logging]
    bad("kube.watch_timeout_seconds", "soon", "must be a number > 0 (seconds)",
        chart="got string, want number"),
    bad("kube.kubeconfig", "/root/\0/config", 'must be a file path, or "" for none'),
    bad("nvml.call_timeout_seconds", 0, "must be a number > 0 (seconds)"),
    bad("logging.level", "verbose", 'must be one of "debug", "info", "warning", "error"',
        chart="value must be one of 'debug', 'info', 'warning', 'error'"),
]  # fmt: skip


def _leaf(config: object) -> object:
    while isinstance(config, dict) and config:
        config = next(iter(config.values()))
    return config


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "…"


def _tables(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if path and (scalars or not table):
        lines.append(f"[{'.'.join(path)}]")
    lines.extend(f"{key} = {_toml(value)}" for key, value in scalars.items())
    for key, sub in table.items():
        if isinstance(sub, dict):
            _tables(sub, [*path, key], lines)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # strings (JSON's escapes are TOML's), ints, floats
