"""NVML adapter package (DESIGN §6): see ``source``."""

from gpuguard.adapters.nvml.source import NvmlGpuSource

__all__ = ["NvmlGpuSource"]
