"""Rigs: what the tests, the benchmarks and the scripts share to build real worlds around the
product (a control plane, cgroup trees, the NVML stand-in and its scenarios, the node harness,
process helpers, DRA objects, and the provenance header every raw output starts with).

Imports only ``gpuguard`` and third-party libraries, never ``tests``, ``benchmarks`` or
``scripts`` (an import-linter contract): each of those imports what it needs from here.
"""
