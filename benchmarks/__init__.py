"""The benchmarks: programs run as modules from the repository root
(``python -m benchmarks.NAME``), each measuring one cost of gpuguard; what they share with the
tests and the scripts is in ``rigs``."""
