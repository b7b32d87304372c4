"""The Python scripts: programs run as modules from the repository root
(``python -m scripts.NAME``); what they share with the tests and the benchmarks is in ``rigs``.
The shell scripts beside them are run as files."""
