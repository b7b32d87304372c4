"""The MIG reconfiguration rule (docs/design.md, MIG reconfiguration): when gpuguard must let go of
NVML.

mig-manager cannot change MIG mode while any process holds the GPU open, so while its node's
``nvidia.com/mig.config.state`` is ``pending`` or ``rebooting`` the enforcer releases NVML
(nvmlShutdown) and pauses enforcement; it resumes on ``success`` or ``failed``. Pure: the loop
that applies it is ``runtime.mig``.
"""

from __future__ import annotations

MIG_PAUSE_STATES = frozenset({"pending", "rebooting"})
"""``nvidia.com/mig.config.state`` values during which NVML is released."""


def nvml_released_during(mig_config_state: str | None) -> bool:
    """Whether NVML must be released while the node's MIG config state is this."""
    return mig_config_state in MIG_PAUSE_STATES
