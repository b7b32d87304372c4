"""gpuguard: a node agent that makes time-sliced NVIDIA GPUs safe to share."""

__version__ = "0.1.0"
