"""NVML adapter (docs/design.md, Architecture): the one place gpuguard talks to the NVIDIA
Management Library.

- ``lib``: pynvml and ctypes: loading and initialising NVML, each NVML function, error codes,
  the ``_v2``/``_v3`` process-array decoding. The only module that imports pynvml.
- ``calls``: one NVML operation at a time, the sample deadline, call timings, the error count.
- ``session``: nvmlInit / nvmlShutdown with the retry backoff, also after a lost handle.
- ``devices``: the full GPUs, described once and cached; ``mig``: MIG instances, re-read every
  sample; ``processes``: the process lists of one enforcement unit.
- ``source``: ``NvmlGpuSource``, the ``ReleasableGpuSource`` built from the above.
- ``null``: ``NullGpuSource``, the wrapper that samples nothing, and says why, while NVML
  cannot start (``nvml.fail_on_init_error = false``).
"""

from gpuguard.adapters.nvml.calls import CallTimings
from gpuguard.adapters.nvml.null import NullGpuSource
from gpuguard.adapters.nvml.source import NvmlGpuSource

__all__ = ["CallTimings", "NullGpuSource", "NvmlGpuSource"]
