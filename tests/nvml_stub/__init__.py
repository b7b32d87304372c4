"""The NVML stand-in library (C) and its Python test harness."""
