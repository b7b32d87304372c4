"""The NVML stand-in library (C), built by its Makefile; its Python side is ``rigs.nvml_stub``."""
