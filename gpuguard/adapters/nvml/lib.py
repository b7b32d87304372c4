"""The NVML library itself: loading and initialising it, the NVML functions gpuguard calls, their
error codes, and the decoding of the ``_v2``/``_v3`` process-info arrays.

Owns every use of pynvml and ctypes in gpuguard (import-linter: no other module imports pynvml).
Each NVML function is an :class:`NvmlFunction` that carries the C function's name (for timings
and ``gpuguard_nvml_errors_total{call}``) and turns pynvml's ``NVMLError`` into
:class:`NvmlCallError`: the call's name, a stable snake_case code (``gpu_is_lost``) and
pynvml's message. Answers that are not failures come back as values (an empty MIG slot is
``None``, a handle without such a process list is ``[]``). Must not keep state beyond the loaded
library, time calls, or decide what a failure means for a sample (``source`` does).
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, NewType, ParamSpec, TypeVar

import pynvml

P = ParamSpec("P")
T = TypeVar("T")

Handle = NewType("Handle", object)
"""An opaque ``nvmlDevice_t`` (a full GPU's or a MIG device's). Handles are stable until
nvmlShutdown, a GPU reset or a MIG reconfiguration."""

NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
"""NVML_VALUE_NOT_AVAILABLE in the u64 ``usedGpuMemory`` field (nvml.h: ``(-1)``)."""

INIT_CALL = "nvmlInitWithFlags"
"""The C function ``pynvml.nvmlInit()`` calls; the ``call`` of every initialisation failure."""

# Error codes the source interprets (nvml.h's NVML_ERROR_* names, without the prefix, lower case).
GPU_IS_LOST = "gpu_is_lost"
FUNCTION_NOT_FOUND = "function_not_found"
INSUFFICIENT_SIZE = "insufficient_size"

REINIT_CODES = frozenset({"uninitialized", "lib_rm_version_mismatch", "driver_not_loaded"})
"""Errors on a global call (the device count) after which NVML must be shut down and
initialised again."""

STALE_HANDLE_CODES = frozenset({GPU_IS_LOST, "reset_required", "invalid_argument", "unknown"})
"""Errors after which a cached GPU handle may be stale (a reset): look the GPU up again."""

BROKEN_HANDLE_CODES = frozenset({"unknown"})
"""Errors that, when every call on every GPU fails with one of them, say NVML's own handle went
bad rather than a GPU: NVML_ERROR_UNKNOWN on every call of a process that keeps NVML open after
``systemctl daemon-reload`` on a node with the NVIDIA container toolkit
(NVIDIA/nvidia-container-toolkit#48, #1227). Not GPU_IS_LOST: that is the GPU (reliability N2),
which re-initialising NVML does not bring back."""

_CODE_NAMES: dict[int, str] = {
    getattr(pynvml, name): name.removeprefix("NVML_ERROR_").lower()
    for name in dir(pynvml)
    if name.startswith("NVML_ERROR_")
}
"""NVML error value -> code (``NVML_ERROR_GPU_IS_LOST`` -> ``gpu_is_lost``); nvml.h gives each
value one name."""

LIBRARY_PATH_SETTING = "GPUGUARD_NVML_LIBRARY_PATH"
"""The environment's name for the config key ``nvml.library_path``, named in load failures (the
setting an operator reaches for when the library is not on the loader's path)."""

# Errors from nvmlInit that mean "NVML cannot be used here", with a hint for the operator.
_INIT_HINTS: dict[str, str] = {
    "library_not_found": (
        "libnvidia-ml.so.1 not found: run with the NVIDIA container runtime (the chart's "
        "runtimeClassName), or mount the driver's libnvidia-ml.so.1 and set nvml.library_path "
        f"({LIBRARY_PATH_SETTING}) to it"
    ),
    "driver_not_loaded": "the NVIDIA kernel driver is not loaded (yet)",
    "no_permission": "no permission to open /dev/nvidiactl",
    "lib_rm_version_mismatch": (
        "libnvidia-ml does not match the loaded kernel module (driver upgraded under us)"
    ),
}


class NvmlCallError(Exception):
    """An NVML call failed. ``str()`` is pynvml's message (``GPU is lost``)."""

    def __init__(self, call: str, code: str, message: str) -> None:
        super().__init__(message)
        self.call = call
        """The NVML C function (``nvmlDeviceGetMemoryInfo``)."""
        self.code = code
        """Stable snake_case code: ``gpu_is_lost``, ``not_supported``, ``error_999``, …"""


class NvmlInitError(NvmlCallError):
    """NVML could not be loaded or initialised. ``str()`` is the whole reason for the operator
    (``nvmlInit failed: no_permission (Insufficient Permissions): no permission to open …``)."""


def error_code(exc: BaseException) -> str:
    """A stable snake_case name for a pynvml error (``gpu_is_lost``), for reasons and metrics."""
    if isinstance(exc, pynvml.NVMLLibraryMismatchError):
        return "library_mismatch"
    value = getattr(exc, "value", None)
    if not isinstance(value, int):
        return "unknown"
    return _CODE_NAMES.get(value, f"error_{value}")


class NvmlFunction(Generic[P, T]):
    """One NVML C function as gpuguard calls it: ``name`` is the C symbol; calling it raises
    :class:`NvmlCallError` instead of pynvml's exceptions."""

    __slots__ = ("_fn", "name")

    def __init__(self, name: str, fn: Callable[P, T]) -> None:
        self.name = name
        self._fn = fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return self._fn(*args, **kwargs)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
            raise NvmlCallError(self.name, error_code(exc), str(exc)) from exc


def _nvml(name: str) -> Callable[[Callable[P, T]], NvmlFunction[P, T]]:
    def wrap(fn: Callable[P, T]) -> NvmlFunction[P, T]:
        return NvmlFunction(name, fn)

    return wrap


# ---------------------------------------------------------------------------------------------
# Loading, init, shutdown

_preloaded: dict[Path, ctypes.CDLL] = {}
_preload_lock = threading.Lock()


def _preload(path: Path) -> None:
    """Load ``path`` globally so pynvml's ``CDLL("libnvidia-ml.so.1")`` resolves to it: glibc's
    dlopen matches an already-loaded object by its SONAME before searching the disk. Kept
    loaded for the life of the process (pynvml caches its handle)."""
    with _preload_lock:
        if path not in _preloaded:
            _preloaded[path] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def init(library_path: Path | None) -> None:
    """nvmlInit, after loading ``library_path`` (``None``: the dynamic loader's search path).
    Raises :class:`NvmlInitError` with the reason and, where one is known, a hint."""
    try:
        if library_path is not None:
            _preload(library_path)
        pynvml.nvmlInit()
    except OSError as exc:
        message = (
            f"cannot load NVML library {library_path} (nvml.library_path, "
            f"{LIBRARY_PATH_SETTING}): {exc}"
        )
        raise NvmlInitError(INIT_CALL, "library_not_found", message) from exc
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
        code = error_code(exc)
        message = f"nvmlInit failed: {code} ({exc})"
        hint = _INIT_HINTS.get(code)
        raise NvmlInitError(
            INIT_CALL, code, message if hint is None else f"{message}: {hint}"
        ) from exc


def shutdown() -> None:
    """nvmlShutdown. An error here means NVML is already uninitialised (the driver was
    reloaded): nothing is left to release, so it is not a failure."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return


@_nvml("nvmlSystemGetDriverVersion")
def driver_version() -> str:
    return str(pynvml.nvmlSystemGetDriverVersion())


# ---------------------------------------------------------------------------------------------
# Devices, memory, MIG


@_nvml("nvmlDeviceGetCount_v2")
def device_count() -> int:
    return int(pynvml.nvmlDeviceGetCount())


@_nvml("nvmlDeviceGetHandleByIndex_v2")
def device_handle(index: int) -> Handle:
    return Handle(pynvml.nvmlDeviceGetHandleByIndex(index))


@_nvml("nvmlDeviceGetUUID")
def device_uuid(handle: Handle) -> str:
    return str(pynvml.nvmlDeviceGetUUID(handle))


@_nvml("nvmlDeviceGetName")
def device_name(handle: Handle) -> str:
    return str(pynvml.nvmlDeviceGetName(handle))


@_nvml("nvmlDeviceGetMemoryInfo")
def memory_total_bytes(handle: Handle) -> int:
    """The memory of a full GPU, or of a MIG device's GPU instance (per-instance memory)."""
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


_fast_count = ctypes.c_uint(0)
_fast_memory = pynvml.c_nvmlMemory_t()


def fast_memory(
    handles: Sequence[Handle], *, seconds: list[float] | None = None
) -> tuple[int, list[tuple[int, int, int] | NvmlCallError]]:
    """The fast read, 20 times a second: ``nvmlDeviceGetCount_v2`` and, per handle (a full GPU,
    or a MIG device of a GPU instance), ``(total, used, free)`` bytes from
    ``nvmlDeviceGetMemoryInfo`` or the :class:`NvmlCallError` of that read. Straight ctypes
    calls into arguments allocated once: through pynvml's wrappers and the call guard the read
    cost twice as much CPU as the C calls it makes. Not thread-safe (the arguments are shared):
    callers hold the call guard. Raises :class:`NvmlCallError` when the count fails.
    ``seconds``, when given, receives how long each handle's read took (which GPU is slow)."""
    nvml = pynvml.nvmlLib
    if nvml is None:
        raise _call_error("nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_UNINITIALIZED)
    ret = nvml.nvmlDeviceGetCount_v2(ctypes.byref(_fast_count))
    if ret != pynvml.NVML_SUCCESS:
        raise _call_error("nvmlDeviceGetCount_v2", ret)
    read = nvml.nvmlDeviceGetMemoryInfo
    out: list[tuple[int, int, int] | NvmlCallError] = []
    for handle in handles:
        started = time.perf_counter() if seconds is not None else 0.0
        ret = read(handle, ctypes.byref(_fast_memory))
        if seconds is not None:
            seconds.append(time.perf_counter() - started)
        if ret == pynvml.NVML_SUCCESS:
            out.append((_fast_memory.total, _fast_memory.used, _fast_memory.free))
        else:
            out.append(_call_error("nvmlDeviceGetMemoryInfo", ret))
    return int(_fast_count.value), out


def fast_memory_addresses(handles: Sequence[Handle]) -> tuple[int, int, list[int]]:
    """What the native quiet gate (``gate.NativeGate``) calls instead of :func:`fast_memory`:
    the addresses of ``nvmlDeviceGetCount_v2`` and ``nvmlDeviceGetMemoryInfo`` in the library
    nvidia-ml-py loaded, and of each handle. Raises :class:`NvmlCallError` when NVML is not
    loaded."""
    nvml = pynvml.nvmlLib
    if nvml is None:
        raise _call_error("nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_UNINITIALIZED)

    def address(thing: Any) -> int:  # a ctypes function or pynvml's device pointer
        return int(ctypes.cast(thing, ctypes.c_void_p).value or 0)

    return (
        address(nvml.nvmlDeviceGetCount_v2),
        address(nvml.nvmlDeviceGetMemoryInfo),
        [address(handle) for handle in handles],
    )


def _call_error(call: str, ret: int) -> NvmlCallError:
    exc = pynvml.NVMLError(ret)
    return NvmlCallError(call, error_code(exc), str(exc))


@_nvml("nvmlDeviceGetMigMode")
def mig_capable(handle: Handle) -> bool:
    """NOT_SUPPORTED: the GPU cannot do MIG (an answer, not a failure)."""
    try:
        pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    return True


@_nvml("nvmlDeviceGetMigMode")
def mig_enabled(handle: Handle) -> bool:
    """MIG mode is on now (the current mode, not the pending one)."""
    current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    return bool(int(current) == pynvml.NVML_DEVICE_MIG_ENABLE)


@_nvml("nvmlDeviceGetMaxMigDeviceCount")
def max_mig_devices(handle: Handle) -> int:
    return int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))


@_nvml("nvmlDeviceGetMigDeviceHandleByIndex")
def mig_device_handle(handle: Handle, slot: int) -> Handle | None:
    """``None`` for an empty slot (NOT_FOUND / INVALID_ARGUMENT, as go-nvlib and dcgm-exporter
    treat them)."""
    try:
        return Handle(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
    except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
        return None


@_nvml("nvmlDeviceGetGpuInstanceId")
def gpu_instance_id(handle: Handle) -> int:
    return int(pynvml.nvmlDeviceGetGpuInstanceId(handle))


@_nvml("nvmlDeviceGetComputeInstanceId")
def compute_instance_id(handle: Handle) -> int:
    return int(pynvml.nvmlDeviceGetComputeInstanceId(handle))


GpuInstance = NewType("GpuInstance", object)
"""An opaque ``nvmlGpuInstance_t``."""

UNANSWERED_CODES = frozenset({"not_supported", "no_permission", FUNCTION_NOT_FOUND})
"""Errors of the GPU instance calls that are answers, not failures: the driver does not say
(an older driver, or an unprivileged caller: nvml.h says the GPU instance calls require a
privileged user)."""


@_nvml("nvmlDeviceGetGpuInstanceById")
def gpu_instance(handle: Handle, gpu_instance_id: int) -> GpuInstance:
    """A full GPU's GPU instance ``gpu_instance_id``."""
    return GpuInstance(pynvml.nvmlDeviceGetGpuInstanceById(handle, gpu_instance_id))


@_nvml("nvmlGpuInstanceGetInfo")
def gpu_instance_placement(instance: GpuInstance) -> tuple[int, int]:
    """The GPU instance's profile ID and placement start (``nvmlGpuInstanceInfo_t``)."""
    info = pynvml.nvmlGpuInstanceGetInfo(instance)
    return int(info.profileId), int(info.placement.start)


# ---------------------------------------------------------------------------------------------
# Process lists

# nvmlProcessInfo_t as the _v2 and _v3 calls fill it: pid u32, (pad), usedGpuMemory u64,
# gpuInstanceId u32, computeInstanceId u32 = 24 bytes (nvml.h's nvmlProcessInfo_t; the same layout
# as pynvml's c_nvmlProcessInfo_v3_t, checked at import below).
_PROCESS_INFO = struct.Struct("=I4xQII")
if ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) != _PROCESS_INFO.size:  # pragma: no cover
    raise ImportError(
        "nvidia-ml-py's c_nvmlProcessInfo_v3_t is not 24 bytes (nvidia-ml-py 12.535.77?): "
        "process PIDs and memory would be garbled; install another nvidia-ml-py"
    )

_process_lists: dict[str, NvmlFunction[[Handle], list[tuple[int, int]]]] = {}


def process_list(symbol: str) -> NvmlFunction[[Handle], list[tuple[int, int]]]:
    """The ``nvmlDevice{Compute,Graphics,MPSCompute}RunningProcesses_{v2,v3}`` function named
    ``symbol``: ``(pid, raw usedGpuMemory)`` per entry; NOT_SUPPORTED (no such list on this
    handle) is ``[]``; a driver without the symbol raises ``function_not_found``; a list that
    grew between the count and the fetch raises ``insufficient_size``."""
    fn = _process_lists.get(symbol)
    if fn is None:

        def read(handle: Handle) -> list[tuple[int, int]]:
            return _read_process_list(symbol, handle)

        fn = _process_lists.setdefault(symbol, NvmlFunction(symbol, read))
    return fn


def _read_process_list(symbol: str, handle: Handle) -> list[tuple[int, int]]:
    """Calls an ``nvmlDevice*RunningProcesses_v2/_v3`` symbol the way pynvml does (a count call,
    then a fetch into ``2n+5`` entries) but decodes the array in one ``struct`` pass instead of
    pynvml's per-entry friendly objects, which cost several µs each (8 GPUs × 100 processes:
    ~7 ms of CPU per poll; see docs/performance.md)."""
    nvml = pynvml.nvmlLib
    if nvml is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
    try:
        fn = getattr(nvml, symbol)
    except AttributeError:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) from None
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED):
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    capacity = count.value * 2 + 5
    count.value = capacity
    buf = ctypes.create_string_buffer(capacity * _PROCESS_INFO.size)
    ret = fn(handle, ctypes.byref(count), buf)
    if ret == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return []
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    n = min(count.value, capacity)
    return [
        (pid, used)
        for pid, used, _gi, _ci in _PROCESS_INFO.iter_unpack(buf.raw[: n * _PROCESS_INFO.size])
    ]
