"""MIG instances: the enforcement units of a GPU, which are its MIG GPU instances in MIG mode,
with the profile and placement of each (how a DRA share of a dynamic MIG device names it).

MIG handles die with their instance (NVML invalidates them on reconfiguration), so instances are
re-enumerated every sample. Owns the slot walk and the merge of compute instances into their GPU
instance (the limit unit). A slot that cannot be read is skipped and counted; a lost GPU propagates
so the source skips the whole GPU. Must not read processes (``processes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuguard.adapters.nvml import lib
from gpuguard.adapters.nvml.calls import CallGuard
from gpuguard.adapters.nvml.devices import PhysicalGpu, Unit, full_gpu
from gpuguard.adapters.nvml.lib import Handle, NvmlCallError
from gpuguard.core.model import DeviceSkip, GpuDevice


@dataclass(frozen=True, slots=True, kw_only=True)
class _Instance:
    handle: Handle
    gi: int
    ci: int
    uuid: str
    name: str
    total_bytes: int


def units_of(calls: CallGuard, gpu: PhysicalGpu, skipped: list[DeviceSkip]) -> list[Unit]:
    """The enforcement units of one GPU: itself, or its MIG GPU instances (by GI id). A MIG
    slot that cannot be read is added to ``skipped``. Raises ``NvmlCallError``.

    NVML: nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMigDeviceHandleByIndex per slot, then per instance :func:`_read_instance`.
    """
    if not gpu.mig_capable or not calls.call(lib.mig_enabled, gpu.handle):
        return [full_gpu(gpu)]
    by_gi: dict[int, Unit] = {}
    for slot in range(calls.call(lib.max_mig_devices, gpu.handle)):
        handle = calls.call(lib.mig_device_handle, gpu.handle, slot)
        if handle is None:  # an empty slot
            continue
        try:
            instance = _read_instance(calls, handle)
        except NvmlCallError as exc:
            if exc.code == lib.GPU_IS_LOST:
                raise
            calls.count_failure(exc)
            reason = f"{exc.code}: MIG slot {slot}: {exc}"
            skipped.append(DeviceSkip(uuid=gpu.uuid, index=gpu.index, reason=reason))
            continue
        _add(by_gi, gpu, instance)
    for gi, unit in by_gi.items():
        placement = _placement(calls, gpu, gi)
        if placement is not None:
            unit.device = replace(unit.device, mig_placement=placement)
    return [by_gi[gi] for gi in sorted(by_gi)]


def _placement(calls: CallGuard, gpu: PhysicalGpu, gi: int) -> tuple[int, int] | None:
    """The GPU instance's profile ID and placement start, by which a DRA share of a dynamic MIG
    device names it (``DraShare.is_on``); ``None`` where NVML does not say (an unprivileged
    caller, an older driver) or the call failed (counted): such a share stays unresolved on
    it, never a guess. NVML: nvmlDeviceGetGpuInstanceById, nvmlGpuInstanceGetInfo."""
    try:
        instance = calls.call(lib.gpu_instance, gpu.handle, gi)
        return calls.call(lib.gpu_instance_placement, instance)
    except NvmlCallError as exc:
        if exc.code == lib.GPU_IS_LOST:
            raise
        if exc.code not in lib.UNANSWERED_CODES:
            calls.count_failure(exc)
        return None


def _read_instance(calls: CallGuard, handle: Handle) -> _Instance:
    """NVML on a MIG device handle: nvmlDeviceGetGpuInstanceId, nvmlDeviceGetComputeInstanceId,
    nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetMemoryInfo (per-instance memory)."""
    return _Instance(
        handle=handle,
        gi=calls.call(lib.gpu_instance_id, handle),
        ci=calls.call(lib.compute_instance_id, handle),
        uuid=calls.call(lib.device_uuid, handle),
        name=calls.call(lib.device_name, handle),
        total_bytes=calls.call(lib.memory_total_bytes, handle),
    )


def _add(by_gi: dict[int, Unit], gpu: PhysicalGpu, instance: _Instance) -> None:
    """Memory belongs to the GPU instance; its compute instances share it. The limit unit is
    the GI (``DeviceKey``), so several CIs of one GI merge into one device without a CI id."""
    unit = by_gi.get(instance.gi)
    if unit is None:
        device = GpuDevice(
            index=gpu.index,
            uuid=gpu.uuid,
            name=instance.name,
            total_bytes=instance.total_bytes,
            gpu_instance_id=instance.gi,
            compute_instance_id=instance.ci,
            mig_uuid=instance.uuid,
        )
        unit = by_gi[instance.gi] = Unit(device=device)
    elif unit.device.compute_instance_id is not None:
        unit.device = replace(unit.device, compute_instance_id=None)
    unit.handles.append(instance.handle)
