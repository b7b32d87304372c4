"""gpuguard's exception vocabulary: the only exceptions the runtime and CLI catch.

Adapters translate vendor exceptions (NVMLError, ApiException, OSError) into these, chaining the
original as ``__cause__``. Transient errors are retried next cycle; permanent ones stop the process
with one clear message.
"""

from __future__ import annotations


class GpuguardError(Exception):
    """Base of every gpuguard error."""


class PermanentError(GpuguardError):
    """Cannot continue: bad config, missing permission at start. Exit non-zero with the message."""


class TransientError(GpuguardError):
    """Try again next cycle."""


class ConfigError(PermanentError):
    """The configuration is invalid. ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class GpuSourceError(TransientError):
    """NVML could not be read this cycle."""


class GpuSourceLost(GpuSourceError):
    """The GPU source's connection to the driver broke: every call fails the same way (NVML's
    handle went bad). It is being re-established with backoff; until a sample arrives again,
    nothing read before is current and enforcement pauses."""


class GpuSourceUnavailable(PermanentError):
    """NVML cannot be used at all (library missing, driver not loaded, no permission)."""


class KubeError(TransientError):
    """The API server could not be reached or answered with a retryable error."""


class WriteConflict(KubeError):
    """``409 Conflict`` on an update or patch: the object changed since the ``resourceVersion``
    the write was based on (another writer won the race). Read it again and decide again."""


class FenceMissing(TransientError):
    """The agent's admission fence is not in force: the API server let through a dry-run write
    the fence would refuse (the chart's ValidatingAdmissionPolicy is missing, not yet active,
    or not bound to the agent's account). The agent writes nothing until it is."""


class KubeForbidden(PermanentError):
    """RBAC denies a verb gpuguard needs. The message names verb and resource."""


class TaskEnded(PermanentError):
    """An eternal task of the runtime returned on its own: the process must not go on half-alive
    (or exit 0 as if asked to stop)."""
