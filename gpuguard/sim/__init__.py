"""The demo's two simulated worlds, in memory, for ``gpuguard demo``: ``sim.node`` (the GPU node
the enforcer runs on) and ``sim.cluster`` (the Nodes the sharing agent reconciles). Neither
touches real processes, /proc, cgroups, NVML or an API server.
"""
