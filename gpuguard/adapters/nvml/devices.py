"""Device enumeration: the full GPUs NVML lists, each described once and cached.

Owns the per-GPU cache (handle, UUID, name, memory total, MIG capability) and when it is
dropped: the device count changed, a per-GPU error suggests a reset, or NVML was shut down.
Must not read MIG instances or processes (``mig``, ``processes``) or catch NVML errors: a
failure reaches the source, which skips the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuguard.adapters.nvml import lib
from gpuguard.adapters.nvml.calls import CallGuard
from gpuguard.adapters.nvml.lib import Handle
from gpuguard.core.model import GpuDevice, GpuUuid


@dataclass(frozen=True, slots=True, kw_only=True)
class PhysicalGpu:
    """What is cached per physical GPU between samples (NVML handles are stable until
    nvmlShutdown, a GPU reset or a MIG reconfiguration; MIG handles are re-read every sample)."""

    handle: Handle
    index: int
    uuid: GpuUuid
    name: str
    total_bytes: int
    mig_capable: bool


@dataclass(slots=True, kw_only=True)
class Unit:
    """One enforcement unit being assembled during a sample: a full GPU, or a MIG GPU instance
    with the handles of its compute instances."""

    device: GpuDevice
    handles: list[Handle] = field(default_factory=list)


class GpuCache:
    """The full GPUs by index. NVML: ``nvmlDeviceGetCount_v2`` every sample; once per GPU
    ``nvmlDeviceGetHandleByIndex_v2``, ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``,
    ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetMigMode`` (NOT_SUPPORTED = not MIG-capable)."""

    def __init__(self, calls: CallGuard) -> None:
        self._calls = calls
        self._gpus: dict[int, PhysicalGpu] = {}
        self._count: int | None = None

    def count(self) -> int:
        """How many GPUs NVML lists now; a change drops every cached GPU (indexes may have
        moved). Raises ``NvmlCallError``."""
        count = self._calls.call(lib.device_count)
        if count != self._count:
            self._gpus.clear()
            self._count = count
        return count

    def get(self, index: int) -> PhysicalGpu:
        """The GPU at ``index``, described on first use. Raises ``NvmlCallError``."""
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = self._describe(index)
            self._gpus[index] = gpu
        return gpu

    def cached(self, index: int) -> PhysicalGpu | None:
        """The GPU at ``index`` if already described (no NVML call)."""
        return self._gpus.get(index)

    def forget(self, index: int) -> None:
        """Look the GPU up again next time (its handle may be stale after a reset)."""
        self._gpus.pop(index, None)

    def clear(self) -> None:
        """Drop everything (NVML shut down: even full-GPU handles may change)."""
        self._gpus.clear()
        self._count = None

    def _describe(self, index: int) -> PhysicalGpu:
        call = self._calls.call
        handle = call(lib.device_handle, index)
        return PhysicalGpu(
            handle=handle,
            index=index,
            uuid=GpuUuid(call(lib.device_uuid, handle)),
            name=call(lib.device_name, handle),
            total_bytes=call(lib.memory_total_bytes, handle),
            mig_capable=call(lib.mig_capable, handle),
        )


def full_gpu(gpu: PhysicalGpu) -> Unit:
    """A GPU not in MIG mode is one enforcement unit."""
    device = GpuDevice(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes)
    return Unit(device=device, handles=[gpu.handle])
