"""``gpuguard demo``: the real enforcer and sharing agent on simulated nodes (docs/design.md, CLI
outputs).

Runs the real core, runtime and metrics over ``gpuguard.sim``: no root, no GPU, no cluster. Act
one: the enforcer on one node for ``--duration`` seconds (at least
``scenario.minimum_duration_seconds()``, from act one's script: the command line refuses less).
Act two (a few seconds): one sharing agent per Node of a simulated cluster labels each Node from
a sharing config and holds a MIG change until its Node is idle. Exit 0 only if the scenario's
expectations held: the offender was stopped within grace + 2 polls of crossing its limit and
nobody else was signalled; every Node got exactly the labels of its first matching rule, the mig
label was never written while a GPU pod was on the Node or while mig-manager was busy, and
nothing but the two sharing labels was written. With ``--metrics-port`` the enforcer's metrics
and the sharing agent's (the real ``PrometheusAgentRecorder`` of one simulated Node, on the same
registry) are served while the demo runs.

The parts, each for one concern:

- ``scenario``: the script, data only: the node's pods and their usage over time, the cluster's
  Nodes and sharing config, the timings, what each act must end with.
- ``enforcer_act``: act one, the real enforcer over the simulated node, its signals and Events
  narrated; ``sharing_act``: act two, a real sharing agent per simulated Node.
- ``narration``: the lines under each live table; ``grid`` and ``view``: the live tables and
  the verdict in words.
- ``verdict``: both acts' checks and the ``demo_summary`` event.
- ``command``: ``run_demo``, the command: logging, the metrics server, both acts, the exit code.
"""

from gpuguard.commands.demo.command import run_demo

__all__ = ["run_demo"]
