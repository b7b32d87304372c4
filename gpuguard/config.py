"""Configuration: one frozen ``Settings`` tree from defaults < TOML file < env < command line.

Owns every tunable's name, type, unit, default and validation, and the translation into the core's
``EnforcementPolicy``. Must not act on the settings (no NVML, no API server, no logging setup):
``app.py`` wires them. Nothing below ``app.py`` reads the environment or files for configuration;
``load_settings`` receives the environment as a mapping so tests pass their own.

Sources, lowest precedence first (docs/design.md, Configuration):

1. the defaults below (each field's docstring gives unit, default and why);
2. a TOML file (``config.example.toml`` documents every key): ``version = 1`` is required, unknown
   versions, sections and keys are errors. Its path: ``config_path``, else ``$GPUGUARD_CONFIG``;
3. environment variables ``GPUGUARD_<SECTION>_<KEY>`` (``GPUGUARD_NODE_NAME``,
   ``GPUGUARD_ENFORCEMENT_MODE``, ``GPUGUARD_LIMITS_EXEMPT_NAMESPACES=a,b``: lists are
   comma-separated, booleans ``true``/``false``). An empty variable counts as unset (Helm
   templates render absent values as ""). ``NODE_NAME`` (the downward API's
   ``spec.nodeName``) is the fallback for ``node.name``. Per-namespace tables are file-only.
   Unknown ``GPUGUARD_*`` variables are errors, except the service links the kubelet injects for
   a Service named ``gpuguard…`` (``GPUGUARD_SERVICE_HOST``, ``GPUGUARD_PORT_9410_TCP``…);
4. command-line overrides: a mapping of dotted keys (``{"enforcement.mode": "enforce"}``) the CLI
   builds from its flags; strings are parsed like environment values.

Every problem found is reported at once in one ``ConfigError``, each naming its source (file,
variable or command line), the key, the bad value and what is allowed; an unknown name also
names the allowed one it most likely meant (``did you mean enforcement.grace_seconds?``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import ipaddress
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpuguard.adapters.kube.quantity import (
    InvalidQuantity,
    checker_grammar,
    parse_limit,
    parse_quantity_bytes,
)
from gpuguard.adapters.manifest import InputError, read_bounded
from gpuguard.core.limits import LARGEST_DEVICE_BYTES, MIN_LIMIT_BYTES, percent_below_minimum
from gpuguard.core.model import (
    FOREIGN_SOURCES,
    GPUGUARD_SOURCE,
    EnforcementPolicy,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    PodUid,
)
from gpuguard.errors import ConfigError

CONFIG_VERSION: Final = 1
ENV_PREFIX: Final = "GPUGUARD_"
CONFIG_PATH_ENV: Final = "GPUGUARD_CONFIG"
NODE_NAME_ENV: Final = "NODE_NAME"


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    AUTO = "auto"
    """JSON when stdout is not a terminal (a pod's log), console otherwise."""
    JSON = "json"
    CONSOLE = "console"


# ---------------------------------------------------------------------------------------------
# Field parsers. Each takes the raw value and whether it came as text (env, flags) and returns
# the typed value or raises _Invalid with "what is allowed".


class _Invalid(ValueError):
    pass


Parser = Callable[[object, bool], Any]


def _parser(parse: Parser) -> dict[str, Parser]:
    return {"parse": parse}


_NUMBER_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Seconds:
    """A number ``> minimum`` (``≥`` when ``inclusive``) and, with ``maximum``, ``≤ maximum``;
    ``unit`` names it in the error (seconds, a fraction). A class, not a closure, so that
    ``checker_rules`` can read the bounds."""

    minimum: float
    inclusive: bool
    maximum: float | None = None
    unit: str = "seconds"

    @property
    def allowed(self) -> str:
        if self.maximum is None:
            bound = f"{'≥' if self.inclusive else '>'} {self.minimum:g}"
        elif self.inclusive:
            bound = f"from {self.minimum:g} to {self.maximum:g}"
        else:
            bound = f"> {self.minimum:g} and ≤ {self.maximum:g}"
        return f"must be a number {bound} ({self.unit})"

    def __call__(self, raw: object, text: bool) -> float:
        if text and isinstance(raw, str) and _NUMBER_TEXT.fullmatch(raw):
            raw = float(raw)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise _Invalid(self.allowed)
        value = float(raw)
        low = value < self.minimum or (value == self.minimum and not self.inclusive)
        if not math.isfinite(value) or low:
            raise _Invalid(self.allowed)
        if self.maximum is not None and value > self.maximum:
            raise _Invalid(self.allowed)
        return value


def _seconds(
    *, minimum: float, inclusive: bool, maximum: float | None = None, unit: str = "seconds"
) -> _Seconds:
    return _Seconds(minimum=minimum, inclusive=inclusive, maximum=maximum, unit=unit)


_BOOL_ALLOWED = "must be true or false"


def _bool(raw: object, text: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if text and isinstance(raw, str):
        lowered = raw.strip().lower()
        if lowered in {"true", "1", "yes", "on"}:
            return True
        if lowered in {"false", "0", "no", "off"}:
            return False
    raise _Invalid(_BOOL_ALLOWED)


@dataclass(frozen=True, slots=True)
class _Choice:
    """One of ``kind``'s values (a class so that ``checker_rules`` can list them)."""

    kind: type[enum.StrEnum]

    @property
    def values(self) -> list[str]:
        return [member.value for member in self.kind]

    @property
    def allowed(self) -> str:
        return "must be one of " + ", ".join(f'"{v}"' for v in self.values)

    def __call__(self, raw: object, text: bool) -> enum.StrEnum:
        if isinstance(raw, str) and raw in self.values:
            return self.kind(raw)
        raise _Invalid(self.allowed)


def _choice(kind: type[enum.StrEnum]) -> _Choice:
    return _Choice(kind)


_ABSOLUTE_PATH_ALLOWED = 'must be an absolute path (e.g. "/host/proc")'
_OPTIONAL_PATH_ALLOWED = 'must be a file path, or "" for none'


def _absolute_path(raw: object, text: bool) -> Path:
    if isinstance(raw, str) and raw.startswith("/") and "\0" not in raw:
        return Path(raw)
    raise _Invalid(_ABSOLUTE_PATH_ALLOWED)


def _optional_path(raw: object, text: bool) -> Path | None:
    if raw == "":
        return None
    if isinstance(raw, str) and "\0" not in raw:
        return Path(raw)
    raise _Invalid(_OPTIONAL_PATH_ALLOWED)


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII
)


_NODE_NAME_ALLOWED = "must be a Kubernetes node name (lower-case DNS subdomain, ≤ 253 characters)"
_NAMESPACE_NAME_ALLOWED = (
    'must be a namespace name (lower-case DNS label, ≤ 63 characters, e.g. "gpuguard")'
)
_OBJECT_NAME_ALLOWED = (
    'must be a ConfigMap name (lower-case DNS subdomain, ≤ 253 characters, e.g. "gpuguard-sharing")'
)


def _node_name(raw: object, text: bool) -> str | None:
    if raw == "":
        return None
    if isinstance(raw, str) and len(raw) <= 253 and _DNS_SUBDOMAIN.fullmatch(raw):
        return raw
    raise _Invalid(_NODE_NAME_ALLOWED)


def _namespace_name(raw: object, text: bool) -> str:
    if isinstance(raw, str) and _DNS_LABEL.fullmatch(raw):
        return raw
    raise _Invalid(_NAMESPACE_NAME_ALLOWED)


def _object_name(raw: object, text: bool) -> str:
    if isinstance(raw, str) and len(raw) <= 253 and _DNS_SUBDOMAIN.fullmatch(raw):
        return raw
    raise _Invalid(_OBJECT_NAME_ALLOWED)


_NAMESPACES_ALLOWED = "must be a list of namespace names (lower-case DNS labels, ≤ 63 characters)"
_NOT_VALID = "; not valid: {values}"


def _namespace_list(raw: object, text: bool) -> frozenset[str]:
    allowed = _NAMESPACES_ALLOWED + ("; in the environment, comma-separated" if text else "")
    items: list[object]
    if text and isinstance(raw, str):
        # An empty entry is a mistake, never "no exemptions": GPUGUARD_..._NAMESPACES="," once
        # silently un-exempted kube-system and NVIDIA's operands. To exempt nothing,
        # say so in the config file: exempt_namespaces = [].
        items = [part.strip() for part in raw.split(",")]
        if "" in items:
            raise _Invalid(
                f"{allowed}; it has an empty entry (to exempt no namespace, set "
                "exempt_namespaces = [] in the config file)"
            )
    elif isinstance(raw, list | tuple | frozenset | set):
        items = list(raw)
    else:
        raise _Invalid(allowed)
    bad = [item for item in items if not (isinstance(item, str) and _DNS_LABEL.fullmatch(item))]
    if bad:
        raise _Invalid(allowed + _NOT_VALID.format(values=", ".join(_render(b) for b in bad)))
    return frozenset(str(item) for item in items)


_SOURCE_NAMES = (GPUGUARD_SOURCE, *(s.value for s in FOREIGN_SOURCES))
_GPUSHARE_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20}


_SOURCES_ALLOWED = "must be a list of limit sources, each once, from " + ", ".join(
    f'"{n}"' for n in _SOURCE_NAMES
)
_SOURCES_EMPTY = ' (default ["gpuguard"])'
_SOURCES_UNKNOWN = "; unknown: {values}"
_SOURCES_TWICE = "; listed twice: {values}"


def _sources(raw: object, text: bool) -> tuple[str, ...]:
    """``limits.sources``: known names, each once, in any order (docs/design.md, Limit sources:
    every listed declaration caps the limit and the smallest binds, so the order is no precedence;
    it only picks which name ``source`` shows on a tie)."""
    if text and isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",")]
    if not isinstance(raw, list | tuple) or not raw:
        raise _Invalid(_SOURCES_ALLOWED + _SOURCES_EMPTY)
    bad = [item for item in raw if item not in _SOURCE_NAMES]
    if bad:
        unknown = ", ".join(_render(b) for b in bad)
        raise _Invalid(_SOURCES_ALLOWED + _SOURCES_UNKNOWN.format(values=unknown))
    if len(set(raw)) != len(raw):
        twice = ", ".join(sorted({str(n) for n in raw if raw.count(n) > 1}))
        raise _Invalid(_SOURCES_ALLOWED + _SOURCES_TWICE.format(values=twice))
    return tuple(str(item) for item in raw)


_GPUSHARE_UNIT_ALLOWED = 'must be "GiB" (gpushare\'s default) or "MiB"'


def _gpushare_unit(raw: object, text: bool) -> str:
    if isinstance(raw, str) and raw in _GPUSHARE_UNITS:
        return raw
    raise _Invalid(_GPUSHARE_UNIT_ALLOWED)


_LIMIT_ALLOWED = 'must be a quantity string such as "8Gi" or a percentage such as "25%"'
_PERCENT_BELOW_MINIMUM = (
    "{value} resolves below the smallest limit of 1Mi even on a 1Ti device: a limit nothing can "
    "stay under would stop every GPU pod"
)


def _limit(raw: object, text: bool) -> LimitValue | None:
    if raw == "":
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise _Invalid(_LIMIT_ALLOWED)
    try:
        value = parse_limit(raw)
    except InvalidQuantity as error:
        raise _Invalid(_reason(error)) from None
    if value.percent is not None and percent_below_minimum(value.percent):
        raise _Invalid(_PERCENT_BELOW_MINIMUM.format(value=raw))
    return value


_SIZE_ALLOWED = 'must be 0 or a quantity string such as "2Gi"'


def _size_bytes(raw: object, text: bool) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise _Invalid(_SIZE_ALLOWED)
    try:
        return parse_quantity_bytes(raw)
    except InvalidQuantity as error:
        if error.code == "zero":  # "0", "0Mi": no reserve is a valid choice here
            return 0
        raise _Invalid(_reason(error)) from None


def _reason(error: InvalidQuantity) -> str:
    """The quantity parser's message without its leading quoted value (ours names it already)."""
    message = str(error)
    quoted = repr(error.text)
    if message.startswith(quoted):
        message = message[len(quoted) :].lstrip()
    return message


_ADDRESS_FORM = (
    'must be "host:port" with a port from 0 to 65535 '
    '(e.g. "0.0.0.0:9410", ":9410" for all interfaces, "[::1]:9410")'
)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([-.A-Za-z0-9]*[A-Za-z0-9])?", re.ASCII)


class InvalidListenAddress(ValueError):
    """A rejected ``host:port``. ``str()`` names the value; ``problem`` is what is wrong and what
    is allowed (for messages that name the value already)."""

    def __init__(self, text: str, problem: str) -> None:
        self.text = text
        self.problem = f"{problem}; {_ADDRESS_FORM}"
        super().__init__(f"{_render(text)}: {self.problem}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenAddress:
    """Where to listen: ``metrics.address`` taken apart."""

    host: str
    """An IPv4 address, a host name, or an IPv6 address without its brackets; "" is every
    interface."""
    port: int
    """0 to 65535; 0 lets the kernel pick one."""


def parse_listen_address(text: str) -> ListenAddress:
    """``host:port``, ``:port`` or ``[IPv6]:port`` → ``ListenAddress``; raises
    ``InvalidListenAddress``. The one parser of listen addresses: config validates with it and
    ``app.py`` binds what it returns."""
    if text.startswith("["):
        host, closing, rest = text[1:].partition("]")
        if not closing:
            raise InvalidListenAddress(text, '"[" without a closing "]"')
        if not rest.startswith(":"):
            raise InvalidListenAddress(text, '":port" must follow "]"')
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidListenAddress(
                text, f"{_render(host)} in brackets is not an IPv6 address"
            ) from None
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise InvalidListenAddress(text, 'no ":port"')
        if ":" in host:
            raise InvalidListenAddress(text, 'IPv6 hosts go in brackets ("[::1]:9410")')
        if host and not _HOST_NAME.fullmatch(host):
            raise InvalidListenAddress(
                text, f"host {_render(host)} is not an IPv4 address or host name"
            )
    # isdigit() alone would take "²" and "٣"; int() alone would take "+1", " 1" and "1_0".
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise InvalidListenAddress(
            text, f"port {_render(port)} is not a whole number from 0 to 65535"
        )
    return ListenAddress(host=host, port=int(port))


def _address(raw: object, text: bool) -> str:
    if not isinstance(raw, str):
        raise _Invalid(_ADDRESS_FORM)
    try:
        parse_listen_address(raw)
    except InvalidListenAddress as error:
        raise _Invalid(error.problem) from None
    return raw


# ---------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSettings:
    """This node and where its kernel interfaces are mounted."""

    name: str | None = field(default=None, metadata=_parser(_node_name))
    """This node's name. Default: unset, then ``$NODE_NAME`` (the downward API's spec.nodeName).
    Required by ``enforce`` (its pod watch selects ``spec.nodeName``); not by ``check-pod``."""
    proc_root: Path = field(default=Path("/proc"), metadata=_parser(_absolute_path))
    """The host's /proc as seen by gpuguard. Default ``/proc``: the enforcer runs with hostPID.
    Set ``/host/proc`` when the host's /proc is mounted there instead."""
    cgroup_root: Path = field(default=Path("/sys/fs/cgroup"), metadata=_parser(_absolute_path))
    """The host's cgroup mount (v1 controllers below it, or the v2 unified tree). Default
    ``/sys/fs/cgroup``: where the kubelet's cgroups live on every supported distribution."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnforcementSettings:
    """The poll loop and the graduated stop (docs/design.md, Enforcement cycle)."""

    mode: Mode = field(default=Mode.AUDIT, metadata=_parser(_choice(Mode)))
    """``enforce`` or ``audit``. Default ``audit``: a first install decides and logs would-be
    stops without sending a signal, so admins see what it would do before it does it."""
    poll_interval_seconds: float = field(
        default=1.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Every GPU's processes are listed at least this often. Default 1: with the fast path
    (``fast_interval_seconds``) a listing follows any move of a GPU's memory within 50 ms, so
    this bounds only what a memory read cannot see (one process freeing what another takes
    within one fast read), and a violation in progress is listed at every fast read once its
    next step is due (its grace period or termination timeout ran out, or its GPU is under
    pressure). With
    the fast path off, this is the poll: set 0.25 for detection within 250 ms."""
    grace_seconds: float = field(
        default=10.0, metadata=_parser(_seconds(minimum=0, inclusive=True))
    )
    """Seconds a pod must stay over its limit, after the warning Event, before SIGTERM.
    Default 10: long enough to ride out a transient peak (allocator caching, cuDNN autotune),
    short enough that neighbours are not starved for long. 0 stops at the second sample."""
    termination_timeout_seconds: float = field(
        default=10.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Seconds from SIGTERM to SIGKILL if the pod is still over its limit. Default 10: time to
    checkpoint or free memory, well below Kubernetes' 30 s termination grace."""
    fast_interval_seconds: float = field(
        default=0.05, metadata=_parser(_seconds(minimum=0, inclusive=True))
    )
    """Seconds between fast reads of each GPU's used memory (~8 µs each); a device's processes
    are listed only when its memory moved by more than ``fast_step_bytes`` since its last
    listing, or at the latest every ``poll_interval_seconds``. Default 0.05: a one-step
    allocation is seen within 50 ms at a fraction of the cost of listing every poll. 0 turns
    the fast path off (every device listed every poll interval). At most the poll interval."""
    fast_step_bytes: int = field(default=64 * 2**20, metadata=_parser(_size_bytes))
    """A move of a device's used memory by more than this since its last listing lists its
    processes again: 0 or a quantity ("64Mi"). Default 64Mi: below any CUDA context (~500 MiB)
    and above allocator noise."""
    pressure_free_fraction: float = field(
        default=0.05,
        metadata=_parser(_seconds(minimum=0, inclusive=True, maximum=1, unit="a fraction")),
    )
    """A device whose free memory is below this fraction of its total is under pressure: a pod
    over its limit there is what makes its neighbours fail next, so the grace period is skipped
    (two fresh listings are still required), as the kubelet's hard eviction thresholds do.
    Default 0.05. 0 turns it off."""
    staleness_seconds: float = field(
        default=30.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Data older than this (GPU sample, pod directory's last API server contact) is never acted
    on. Default 30: must exceed 2 poll intervals, the NVML call timeout and the kube watch
    timeout (every re-watch is a contact), else healthy data would look stale."""
    use_cgroup_kill: bool = field(default=False, metadata=_parser(_bool))
    """Send SIGKILL through cgroup v2 ``cgroup.kill`` instead of per-process pidfds. Default
    false: cgroup.kill cannot re-verify each member's identity before the signal, which the
    no-wrong-kill invariant asks for; enable only where a container's processes fork faster
    than pidfds can follow."""
    lock_file: Path = field(
        default=Path("/run/gpuguard/enforcer.lock"), metadata=_parser(_absolute_path)
    )
    """The node lock: only the enforcer that holds an ``flock`` on this file acts; another one
    on the same node stands by (serves metrics, not ready, acts on nothing) until it is free.
    Default ``/run/gpuguard/enforcer.lock``: the chart mounts the host's ``/run/gpuguard``
    there, so every enforcer on a node (two releases, one started by hand) shares it. Its
    directory is created when missing; a file that cannot be opened stops ``enforce`` at start."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceSettings:
    """``[limits.namespaces.<namespace>]``: admin policy for one namespace."""

    default: LimitValue | None = field(default=None, metadata=_parser(_limit))
    """Limit for pods of this namespace without an annotation (quantity or %). Default none."""
    max: LimitValue | None = field(default=None, metadata=_parser(_limit))
    """Cap on every limit in this namespace, annotations included (tenants can only tighten).
    Default none."""
    mode: Mode | None = field(default=None, metadata=_parser(_choice(Mode)))
    """Overrides ``enforcement.mode`` here (``audit`` while a team onboards). Default: global."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsSettings:
    """Admin limit policy (docs/design.md, Limit sources): defaults, maximums and exemptions, never
    from pods."""

    default: LimitValue | None = field(default=None, metadata=_parser(_limit))
    """Cluster default for pods without an annotation: a quantity (``"16Gi"``) or a percentage
    of each device (``"25%"``). Default none: only annotated pods are limited."""
    replicas_default: bool = field(default=False, metadata=_parser(_bool))
    """Give unannotated pods on a time-sliced GPU (``nvidia.com/gpu.replicas`` ≥ 2)
    ``(device memory − replicas_reserve_bytes) / replicas``, when no default above applies.
    Default false: an implicit limit can surprise existing workloads; opt in."""
    replicas_reserve_bytes: int = field(default=0, metadata=_parser(_size_bytes))
    """Memory kept out of the replicas split (a quantity, e.g. ``"2Gi"``, or 0), for CUDA
    contexts and the driver. Default 0."""
    exempt_namespaces: frozenset[str] = field(
        default=frozenset(
            {"kube-system", "gpu-operator", "nvidia-gpu-operator", "nvidia-device-plugin"}
        ),
        metadata=_parser(_namespace_list),
    )
    """Namespaces never acted on (reported only). Replaces, not extends, the default:
    kube-system and the namespaces NVIDIA's GPU operator (``gpu-operator``, OpenShift's
    ``nvidia-gpu-operator``) and device plugin chart install into: stopping the device plugin,
    DCGM or the validator would take the GPU away from everyone."""
    sources: tuple[str, ...] = field(default=(GPUGUARD_SOURCE,), metadata=_parser(_sources))
    """Where pod limits come from: ``gpuguard`` (the annotation) and the other schedulers whose
    declarations gpuguard should enforce: ``kai``, ``hami``, ``gpushare``, ``volcano``
    (docs/design.md, Limit sources). Every listed declaration on a pod caps its limit and the
    smallest binds (a pod's own annotation never raises what a scheduler declared); the order only
    breaks ties. Default ``["gpuguard"]``: nothing else is read unless an admin opts in."""
    gpushare_unit: str = field(default="GiB", metadata=_parser(_gpushare_unit))
    """The unit of gpushare's ``aliyun.com/gpu-mem``: ``"GiB"`` (its default) or ``"MiB"``
    (its ``--memory-unit=MiB`` deployments). Read only with ``gpushare`` in ``sources``."""
    namespaces: Mapping[str, NamespaceSettings] = field(default_factory=dict)
    """``[limits.namespaces.<namespace>]`` tables (file only). Default none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSettings:
    """The sharing agent (``gpuguard agent``, docs/design.md, Sharing config): where its config
    lives, how often it re-decides and writes its Node, and what it may do to drain one for a MIG
    change."""

    sharing_namespace: str = field(default="gpuguard", metadata=_parser(_namespace_name))
    """Namespace of the sharing ConfigMap. Default ``gpuguard``: where the chart and
    ``manifests/rbac.yaml`` install gpuguard and grant the agent read access to it."""
    sharing_name: str = field(default="gpuguard-sharing", metadata=_parser(_object_name))
    """Name of the sharing ConfigMap (key ``sharing.yaml``). Default ``gpuguard-sharing``: the
    one ConfigMap ``manifests/rbac.yaml`` lets the agent read in its namespace."""
    allow_eviction: bool = field(default=False, metadata=_parser(_bool))
    """Let ``migChangePolicy: Drain`` evict the node's GPU pods through the Eviction API
    (PodDisruptionBudgets honoured). Default false: evicting tenants' pods is opt-in; without it
    Drain cordons and waits for the GPU pods to finish, and says so. The Helm value
    ``agent.allowEviction`` sets it and grants ``pods/eviction create`` (without Helm, apply
    ``manifests/agent-eviction-rbac.yaml`` too)."""
    keep_cordon_on_failure: bool = field(default=False, metadata=_parser(_bool))
    """When mig-manager reports ``failed``, leave the agent's own cordon in place for the admin
    to inspect. Default false: uncordon, so a failed MIG change does not take the node's GPUs
    out of service; the failure is reported either way (Event ``MigChangeFailed``)."""
    metrics_address: str = field(default="0.0.0.0:9411", metadata=_parser(_address))
    """``host:port`` for the agent's ``/metrics``, ``/healthz`` and ``/readyz``. Default
    ``0.0.0.0:9411``: the enforcer listens on ``metrics.address`` (9410) in the same pod, and
    the two containers share its network namespace."""
    interval_seconds: float = field(
        default=1.0, metadata=_parser(_seconds(minimum=0.05, inclusive=True, maximum=60))
    )
    """Seconds between the agent's decisions (watches feed it in between). Default 1: a new
    config or a finished MIG change is acted on within a second at negligible CPU. From 0.05
    to 60."""
    min_write_interval_seconds: float = field(
        default=1.0, metadata=_parser(_seconds(minimum=0, inclusive=True, maximum=60))
    )
    """At most one write to the Node (label patch, cordon) per this many seconds, so a fight
    with another writer cannot flood the API server. Default 1. From 0 (no limit) to 60."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    """The HTTP endpoint for ``/metrics``, ``/healthz`` and ``/readyz``."""

    address: str = field(default="0.0.0.0:9410", metadata=_parser(_address))
    """``host:port`` to listen on. Default ``0.0.0.0:9410``: all interfaces so Prometheus can
    scrape the pod, and a port beside dcgm-exporter's 9400, not on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeSettings:
    """The API server connection (pod directory, Events, node labels)."""

    kubeconfig: Path | None = field(default=None, metadata=_parser(_optional_path))
    """A kubeconfig file. Default none: the in-cluster service account (the DaemonSet's)."""
    connect_timeout_seconds: float = field(
        default=5.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Seconds to establish a connection to the API server. Default 5."""
    request_timeout_seconds: float = field(
        default=10.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Seconds for one non-watch request (list, Event, label patch). Default 10: a slow API
    server delays an Event, never the poll loop (requests run off the event loop)."""
    watch_timeout_seconds: float = field(
        default=20.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Server-side length of one pod watch; each re-watch counts as contact. Default 20: must
    stay below ``enforcement.staleness_seconds`` so a quiet node's cache does not look stale."""
    inactivity_seconds: float = field(
        default=15.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """A watch silent this long past its timeout is dropped and restarted (half-open TCP).
    Default 15."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmlSettings:
    """The NVIDIA Management Library."""

    library_path: Path | None = field(default=None, metadata=_parser(_optional_path))
    """An explicit ``libnvidia-ml.so.1``. Default none: the dynamic loader's search (the NVIDIA
    container toolkit mounts it); set e.g. ``/host/usr/lib64/libnvidia-ml.so.1`` otherwise."""
    fail_on_init_error: bool = field(default=True, metadata=_parser(_bool))
    """Exit when NVML cannot be initialised at start. Default true (like GFD): a node agent that
    silently enforces nothing is worse than a crash-looping one. false: run, report, retry."""
    call_timeout_seconds: float = field(
        default=5.0, metadata=_parser(_seconds(minimum=0, inclusive=False))
    )
    """Seconds one NVML gather may take before the cycle gives up on it (NVML can hang on a
    failing GPU). Default 5: must stay below ``enforcement.staleness_seconds``."""
    graphics_processes: bool = field(default=True, metadata=_parser(_bool))
    """Also list graphics processes (and charge their memory). Default true: a pod rendering
    with Vulkan/EGL holds GPU memory too. Each list costs ~1 ms of driver CPU per GPU at 100
    processes (docs/performance.md); turn off on compute-only nodes to halve the poll cost."""
    mps_processes: bool = field(default=True, metadata=_parser(_bool))
    """Also list MPS client processes, which marks a GPU as MPS-served (never enforced by
    signals). Default true; turn off only where MPS is never used."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingSettings:
    """structlog output."""

    level: LogLevel = field(default=LogLevel.INFO, metadata=_parser(_choice(LogLevel)))
    """``debug`` (one ``poll_finished`` line per cycle), ``info``, ``warning`` or ``error``.
    Default ``info``: violations, stops and problems, without a line per poll."""
    format: LogFormat = field(default=LogFormat.AUTO, metadata=_parser(_choice(LogFormat)))
    """``auto``, ``json`` or ``console``. Default ``auto``: JSON in a pod, console on a
    terminal."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every setting of gpuguard, grouped as in the TOML file."""

    node: NodeSettings = field(default_factory=NodeSettings)
    enforcement: EnforcementSettings = field(default_factory=EnforcementSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    kube: KubeSettings = field(default_factory=KubeSettings)
    nvml: NvmlSettings = field(default_factory=NvmlSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)

    def limit_policy(self) -> LimitPolicy:
        """The admin limit policy ``core.limits`` resolves against."""
        limits = self.limits
        return LimitPolicy(
            cluster_default=limits.default,
            namespaces={
                name: NamespacePolicy(default_limit=ns.default, max_limit=ns.max, mode=ns.mode)
                for name, ns in limits.namespaces.items()
            },
            replicas_default=limits.replicas_default,
            replicas_reserve_bytes=limits.replicas_reserve_bytes,
            exempt_namespaces=limits.exempt_namespaces,
            sources=limits.sources,
            gpushare_unit_bytes=_GPUSHARE_UNITS[limits.gpushare_unit],
        )

    def enforcement_policy(self, self_pod_uid: PodUid | None = None) -> EnforcementPolicy:
        """Everything ``decide()`` needs; ``self_pod_uid`` (downward API) is never acted on."""
        enforcement = self.enforcement
        return EnforcementPolicy(
            mode=enforcement.mode,
            grace_seconds=enforcement.grace_seconds,
            termination_timeout_seconds=enforcement.termination_timeout_seconds,
            staleness_seconds=enforcement.staleness_seconds,
            pressure_free_fraction=enforcement.pressure_free_fraction,
            limits=self.limit_policy(),
            self_pod_uid=self_pod_uid,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, for the one ``config_loaded`` log line at start."""
        return {
            section: {
                f.name: _plain(getattr(getattr(self, section), f.name))
                for f in dataclasses.fields(cls)
            }
            for section, cls in SECTIONS.items()
        }


SECTIONS: Final[Mapping[str, type[Any]]] = {
    "node": NodeSettings,
    "enforcement": EnforcementSettings,
    "limits": LimitsSettings,
    "agent": AgentSettings,
    "metrics": MetricsSettings,
    "kube": KubeSettings,
    "nvml": NvmlSettings,
    "logging": LoggingSettings,
}
"""TOML section → its dataclass, in file order."""

_FILE_ONLY: Final = {("limits", "namespaces")}


def env_var(section: str, key: str) -> str:
    """The environment variable for ``section.key``: ``GPUGUARD_<SECTION>_<KEY>``."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def settable_keys() -> list[tuple[str, str]]:
    """Every ``(section, key)`` settable by file, env or flag (namespaces: file only)."""
    return [
        (section, f.name)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if (section, f.name) not in _FILE_ONLY
    ]


def checker_rules() -> dict[str, Any]:
    """What the loader accepts, as JSON-ready data, for checkers that cannot call it: the Helm
    chart's values.schema.json and render-time check (``scripts/gen_values_schema.py`` writes
    both from this, and tests hold them to it).

    ``fields``: section → key → rule, in file order; ``namespace``: the keys of a
    ``[limits.namespaces.<name>]`` table. A rule is ``{"kind", "allowed", "default", ...}``:
    ``allowed`` is the loader's own words, the other entries the kind's bounds, patterns
    (anchored, in the syntax ECMA-262 and Go's RE2 share) or values. Then the cross-key checks and
    their messages, and the quantity grammar (``quantity.checker_grammar``). Messages are
    ``str.format`` templates: each ``{name}`` is filled in as the loader does.
    """
    return {
        "fields": {
            section: {f.name: _checker_rule(f) for f in dataclasses.fields(cls)}
            for section, cls in SECTIONS.items()
        },
        "namespace": {f.name: _checker_rule(f) for f in dataclasses.fields(NamespaceSettings)},
        "namespace_name": {"pattern": f"^{_DNS_LABEL.pattern}$", "message": _NOT_A_NAMESPACE},
        "default_above_max": _DEFAULT_ABOVE_MAX,
        "staleness": {
            "bounds": [
                {"section": s, "key": k, "factor": f, "what": what, "why": why}
                for s, k, f, what, why in _STALENESS_BOUNDS
            ],
            "message": _STALE,
        },
        "fast_interval": _FAST_ABOVE_POLL,
        "percent_below_minimum": {
            "smallest_percent": _smallest_percent(),
            "message": _PERCENT_BELOW_MINIMUM,
        },
        "quantity": checker_grammar(),
    }


def _checker_rule(spec: dataclasses.Field[Any]) -> dict[str, Any]:
    default = (
        _plain(spec.default_factory())
        if spec.default_factory is not dataclasses.MISSING
        else _plain(spec.default)
    )
    if "parse" not in spec.metadata:  # limits.namespaces: tables, see "namespace"
        return {"kind": "tables", "allowed": "tables [limits.namespaces.<namespace>]"}
    parse = spec.metadata["parse"]
    rule: dict[str, Any]
    if isinstance(parse, _Seconds):
        rule = {
            "kind": "number",
            "minimum": parse.minimum,
            "inclusive": parse.inclusive,
            "maximum": parse.maximum,
            "allowed": parse.allowed,
        }
    elif isinstance(parse, _Choice):
        rule = {"kind": "enum", "values": parse.values, "allowed": parse.allowed}
    else:
        rule = dict(_CHECKER_RULES[parse])
    return {**rule, "default": default}


_QUANTITY_RULE = {"kind": "quantity", "percent": False, "zero": False, "empty": False}
_NAME_RULE = {"kind": "name", "empty": False, "max_length": 253}
_CHECKER_RULES: Final[Mapping[Parser, Mapping[str, Any]]] = {
    _bool: {"kind": "boolean", "allowed": _BOOL_ALLOWED},
    _gpushare_unit: {"kind": "enum", "values": list(_GPUSHARE_UNITS),
                     "allowed": _GPUSHARE_UNIT_ALLOWED},
    _limit: {**_QUANTITY_RULE, "percent": True, "empty": True, "min_bytes": MIN_LIMIT_BYTES,
             "allowed": _LIMIT_ALLOWED},
    _size_bytes: {**_QUANTITY_RULE, "zero": True, "min_bytes": 0, "allowed": _SIZE_ALLOWED},
    _namespace_list: {"kind": "namespaces", "pattern": f"^{_DNS_LABEL.pattern}$",
                      "allowed": _NAMESPACES_ALLOWED, "not_valid": _NOT_VALID},
    _sources: {"kind": "sources", "values": list(_SOURCE_NAMES), "allowed": _SOURCES_ALLOWED,
               "empty": _SOURCES_EMPTY, "unknown": _SOURCES_UNKNOWN, "twice": _SOURCES_TWICE},
    _absolute_path: {"kind": "path", "absolute": True, "allowed": _ABSOLUTE_PATH_ALLOWED},
    _optional_path: {"kind": "path", "absolute": False, "allowed": _OPTIONAL_PATH_ALLOWED},
    _node_name: {**_NAME_RULE, "pattern": f"^{_DNS_SUBDOMAIN.pattern}$", "empty": True,
                 "allowed": _NODE_NAME_ALLOWED},
    _namespace_name: {**_NAME_RULE, "pattern": f"^{_DNS_LABEL.pattern}$", "max_length": 63,
                      "allowed": _NAMESPACE_NAME_ALLOWED},
    _object_name: {**_NAME_RULE, "pattern": f"^{_DNS_SUBDOMAIN.pattern}$",
                   "allowed": _OBJECT_NAME_ALLOWED},
    _address: {"kind": "address", "allowed": _ADDRESS_FORM},
}  # fmt: skip
"""The rule of each parser that is a plain function (``_Seconds`` and ``_Choice`` carry their
own); a new parser without one fails ``checker_rules``."""


def _smallest_percent() -> float:
    """The smallest percentage ``percent_below_minimum`` lets through, exactly (a float): below it
    a limit is refused. Found next to ``100 × MIN_LIMIT_BYTES / LARGEST_DEVICE_BYTES``, so that a
    checker comparing with it decides as the float arithmetic of ``percent_below_minimum``."""
    percent = 100 * MIN_LIMIT_BYTES / LARGEST_DEVICE_BYTES
    while percent_below_minimum(percent):
        percent = math.nextafter(percent, math.inf)
    while not percent_below_minimum(below := math.nextafter(percent, 0)):
        percent = below
    return percent


# ---------------------------------------------------------------------------------------------
# Loading


_SERVICE_LINK = re.compile(
    r"GPUGUARD(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
    r"|PORT(_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)",
    re.ASCII,
)
"""Variables the kubelet injects for a Service named ``gpuguard…`` (enableServiceLinks)."""


MAX_CONFIG_BYTES = 1 << 20
"""A config file is a few KiB; anything over 1 MiB is the wrong file."""


_NOT_A_NAMESPACE = "{name} is not a namespace name (lower-case DNS label, ≤ 63 characters)"
_DEFAULT_ABOVE_MAX = (
    "{table}.default is above {table}.max: the default would always be capped; lower the "
    "default or raise the maximum"
)
_STALENESS_BOUNDS: Final = (
    ("enforcement", "poll_interval_seconds", 2, "twice enforcement.poll_interval_seconds",
     "every sample would be stale"),
    ("nvml", "call_timeout_seconds", 1, "nvml.call_timeout_seconds",
     "a slow NVML call would make every sample stale"),
    ("kube", "watch_timeout_seconds", 1, "kube.watch_timeout_seconds",
     "a quiet node's pod cache would look stale"),
)  # fmt: skip
"""``enforcement.staleness_seconds`` must exceed ``factor`` × each ``section.key``: what, why."""
_STALE = "must be more than {what} ({bound}, from {source}), else {why}"
_FAST_ABOVE_POLL = (
    "must not exceed enforcement.poll_interval_seconds ({poll}, from {source}): every device is "
    "listed each poll interval anyway (0 turns the fast path off)"
)


@dataclass(slots=True)
class _Loader:
    problems: list[str] = field(default_factory=list)
    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    origins: dict[tuple[str, str], str] = field(default_factory=dict)
    namespaces: dict[str, NamespaceSettings] = field(default_factory=dict)
    uses_api_server: bool = True

    def set(self, section: str, key: str, raw: object, *, text: bool, origin: str) -> None:
        cls = SECTIONS[section]
        spec = {f.name: f for f in dataclasses.fields(cls)}[key]
        try:
            value = spec.metadata["parse"](raw, text)
        except _Invalid as problem:
            self.problems.append(f"{origin}: {section}.{key} = {_render(raw)}: {problem}")
            self.values.pop((section, key), None)
            self.origins[(section, key)] = origin
            return
        self.values[(section, key)] = value
        self.origins[(section, key)] = origin

    # -- file ----------------------------------------------------------------------------------

    def load_file(self, path: Path) -> None:
        where = str(path)
        try:
            # Bounded and regular files only: /dev/zero or a FIFO as --config exhausted memory
            # or hung.
            data = tomllib.loads(read_bounded(path, max_bytes=MAX_CONFIG_BYTES, what="config file"))
        except InputError as error:
            self.problems.append(str(error))
            return
        except tomllib.TOMLDecodeError as error:
            self.problems.append(f"{where}: TOML syntax error: {error}")
            return
        version = data.pop("version", None)
        if version is None:
            self.problems.append(
                f"{where}: missing version = {CONFIG_VERSION} (required before any section)"
            )
        elif type(version) is not int or version != CONFIG_VERSION:
            self.problems.append(
                f"{where}: version = {_render(version)}: unsupported, this gpuguard reads "
                f"version = {CONFIG_VERSION}"
            )
        for section, table in data.items():
            if section not in SECTIONS:
                close = _closest(section, SECTIONS)
                self.problems.append(
                    f"{where}: unknown key {section}"
                    + ("" if close is None else f": did you mean [{close}]?")
                    + " (allowed: version and the sections "
                    + ", ".join(f"[{s}]" for s in SECTIONS)
                    + ")"
                )
                continue
            if not isinstance(table, dict):
                self.problems.append(
                    f"{where}: {section} = {_render(table)}: must be a table [{section}]"
                )
                continue
            self._load_section(where, section, table)

    def _load_section(self, where: str, section: str, table: dict[str, Any]) -> None:
        known = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for key, raw in table.items():
            if key not in known:
                close = _closest(key, known)
                self.problems.append(
                    f"{where}: unknown key {section}.{key}"
                    + ("" if close is None else f": did you mean {section}.{close}?")
                    + f" (allowed in [{section}]: "
                    + ", ".join(known)
                    + ")"
                )
            elif (section, key) == ("limits", "namespaces"):
                self._load_namespaces(where, raw)
            else:
                self.set(section, key, raw, text=False, origin=where)

    def _load_namespaces(self, where: str, raw: object) -> None:
        if not isinstance(raw, dict):
            self.problems.append(
                f"{where}: limits.namespaces = {_render(raw)}: must be tables "
                "[limits.namespaces.<namespace>]"
            )
            return
        known = {f.name: f for f in dataclasses.fields(NamespaceSettings)}
        for namespace, table in raw.items():
            prefix = f"limits.namespaces.{_key(namespace)}"
            if not _DNS_LABEL.fullmatch(namespace):
                self.problems.append(
                    f"{where}: [{prefix}]: " + _NOT_A_NAMESPACE.format(name=repr(namespace))
                )
                continue
            if not isinstance(table, dict):
                self.problems.append(
                    f"{where}: {prefix} = {_render(table)}: must be a table [{prefix}]"
                )
                continue
            values: dict[str, Any] = {}
            for key, value in table.items():
                if key not in known:
                    close = _closest(key, known)
                    self.problems.append(
                        f"{where}: unknown key {prefix}.{key}"
                        + ("" if close is None else f": did you mean {prefix}.{close}?")
                        + " (allowed: "
                        + ", ".join(known)
                        + ")"
                    )
                    continue
                try:
                    values[key] = known[key].metadata["parse"](value, False)
                except _Invalid as problem:
                    self.problems.append(f"{where}: {prefix}.{key} = {_render(value)}: {problem}")
            self.namespaces[namespace] = NamespaceSettings(**values)
            self._check_default_within_max(where, prefix, self.namespaces[namespace])

    def _check_default_within_max(self, where: str, prefix: str, ns: NamespaceSettings) -> None:
        if ns.default is None or ns.max is None:
            return
        default, maximum = ns.default, ns.max
        above = False
        if default.limit_bytes is not None and maximum.limit_bytes is not None:
            above = default.limit_bytes > maximum.limit_bytes
        elif default.percent is not None and maximum.percent is not None:
            above = default.percent > maximum.percent
        if above:
            self.problems.append(f"{where}: " + _DEFAULT_ABOVE_MAX.format(table=prefix))

    # -- environment and command line ---------------------------------------------------------

    def load_env(self, environ: Mapping[str, str]) -> None:
        known = {env_var(s, k): (s, k) for s, k in settable_keys()}
        for name in sorted(environ):
            if not name.startswith(ENV_PREFIX) or name == CONFIG_PATH_ENV:
                continue
            value = environ[name]
            if name in known:
                if value != "":
                    section, key = known[name]
                    self.set(section, key, value, text=True, origin=f"env {name}")
            elif not _SERVICE_LINK.fullmatch(name):
                # Without the prefix every variable shares, "GPUGUARD_FOO" is close to nothing.
                close = _closest(
                    name.removeprefix(ENV_PREFIX), [k[len(ENV_PREFIX) :] for k in known]
                )
                if close is not None:
                    close = ENV_PREFIX + close
                self.problems.append(
                    f"env {name}: unknown setting"
                    + ("" if close is None else f": did you mean {close}?")
                    + " (GPUGUARD_<SECTION>_<KEY>, e.g. "
                    "GPUGUARD_ENFORCEMENT_MODE; per-namespace limits are file-only)"
                )
        if ("node", "name") not in self.values and environ.get(NODE_NAME_ENV, "") != "":
            self.set(
                "node", "name", environ[NODE_NAME_ENV], text=True, origin=f"env {NODE_NAME_ENV}"
            )

    def load_overrides(self, overrides: Mapping[str, object]) -> None:
        known = set(settable_keys())
        for dotted, raw in overrides.items():
            section, _, key = dotted.partition(".")
            if (section, key) not in known:
                close = _closest(dotted, [f"{s}.{k}" for s, k in known])
                self.problems.append(
                    f"command line: unknown setting {dotted}"
                    + ("" if close is None else f": did you mean {close}?")
                    + " (section.key, e.g. enforcement.mode)"
                )
                continue
            self.set(section, key, raw, text=isinstance(raw, str), origin="command line")

    # -- result --------------------------------------------------------------------------------

    def build(self) -> Settings:
        groups: dict[str, Any] = {}
        for section, cls in SECTIONS.items():
            kwargs = {k: v for (s, k), v in self.values.items() if s == section}
            if section == "limits":
                kwargs["namespaces"] = dict(self.namespaces)
            groups[section] = cls(**kwargs)
        settings = Settings(**groups)
        self._check_invariants(settings)
        if self.problems:
            raise ConfigError(self.problems)
        return settings

    def _check_invariants(self, settings: Settings) -> None:
        self._check_fast_interval(settings)
        staleness = settings.enforcement.staleness_seconds
        for section, key, factor, what, why in _STALENESS_BOUNDS:
            if section == "kube" and not self.uses_api_server:
                continue  # a pods file has no watch: its timeout bounds nothing
            if self._bad(("enforcement", "staleness_seconds"), (section, key)):
                continue
            bound = factor * getattr(getattr(settings, section), key)
            if staleness <= bound:
                origin = self.origins.get(("enforcement", "staleness_seconds"), "defaults")
                other = self.origins.get((section, key), "default")
                self.problems.append(
                    f"{origin}: enforcement.staleness_seconds = {staleness:g}: "
                    + _STALE.format(what=what, bound=f"{bound:g}", source=other, why=why)
                )

    def _check_fast_interval(self, settings: Settings) -> None:
        fast = settings.enforcement.fast_interval_seconds
        poll = settings.enforcement.poll_interval_seconds
        keys = (("enforcement", "fast_interval_seconds"), ("enforcement", "poll_interval_seconds"))
        if self._bad(*keys) or fast <= poll:
            return
        origin = self.origins.get(keys[0], "defaults")
        other = self.origins.get(keys[1], "default")
        self.problems.append(
            f"{origin}: enforcement.fast_interval_seconds = {fast:g}: "
            + _FAST_ABOVE_POLL.format(poll=f"{poll:g}", source=other)
        )

    def _bad(self, *keys: tuple[str, str]) -> bool:
        """A key that failed its own check: invariants about it would only repeat the problem."""
        return any(k in self.origins and k not in self.values for k in keys)


def load_settings(
    *,
    config_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    uses_api_server: bool = True,
) -> Settings:
    """Settings from defaults < file < environment < overrides; raises one ``ConfigError``.

    ``config_path`` ``None``: ``$GPUGUARD_CONFIG`` if set, else no file. ``environ`` ``None``:
    the process environment (pass ``{}`` to ignore it). ``overrides``: dotted keys from flags.
    ``uses_api_server`` false (``--pods-file``): checks that only concern the API server's
    watches are skipped.
    """
    env = os.environ if environ is None else environ
    loader = _Loader(uses_api_server=uses_api_server)
    path = config_path if config_path is not None else env.get(CONFIG_PATH_ENV) or None
    if path is not None:
        loader.load_file(Path(path))
    loader.load_env(env)
    loader.load_overrides(overrides or {})
    return loader.build()


# ---------------------------------------------------------------------------------------------
# Rendering


def _render(value: object) -> str:
    """A value as TOML would spell it, for messages (strings quoted, booleans lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:60] + "…"
        return json.dumps(shown, ensure_ascii=False)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{…}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value[:5]) + (", …]" if len(value) > 5 else "]")
    return type(value).__name__


_SUGGEST_MAX_CHARS = 100
"""Longer names get no suggestion: no key is that long, and comparing costs time."""


def _closest(name: object, allowed: Iterable[str]) -> str | None:
    """The allowed name a typo most likely meant (``grace_second`` → ``grace_seconds``), by
    ``difflib``'s similarity ratio of at least 0.6; ``None`` when none is that close."""
    if not isinstance(name, str) or len(name) > _SUGGEST_MAX_CHARS:
        return None
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    return close[0] if close else None


def _key(name: str) -> str:
    """A TOML key, quoted when it is not bare."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name, re.ASCII) else json.dumps(name)


def _plain(value: object) -> object:
    """A settings value as TOML/JSON would hold it: tables recursively, then leaves."""
    if isinstance(value, NamespaceSettings):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return _plain_leaf(value)


def _plain_leaf(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, LimitValue):
        return f"{value.percent:g}%" if value.percent is not None else value.limit_bytes
    return value
