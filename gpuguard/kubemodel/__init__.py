"""kubemodel: Kubernetes objects as data, read into ``core.model``; the product's one user-facing
grammar (the ``gpuguard.io/gpu-memory-limit`` quantity) lives here.

Owns what a Kubernetes object, already decoded to JSON-shaped Python values, means to gpuguard,
one job a module:

- ``quantity``: the quantity grammar and its values, exactly as the API server parses them (the
  limit annotation, size-valued config keys, container resource counts);
- ``declared``: other GPU-sharing schedulers' memory declarations on a pod;
- ``dra``: DRA claims, slices and a pod's DRA fields → the pod's ``dra`` declaration;
- ``dra_templates``: DRA claims and claim templates found in manifests, for ``check-pod``;
- ``translate``: a Pod → ``Pod``, a Node → ``NodeFacts`` / ``NodeView``, a Namespace → exempt or
  not.

Its callers are every source of those objects: the API server (``adapters.kube``), the pods file
(``adapters.podfile``), ``check-pod``, the config (size keys) and the simulator. Pure, like
NVIDIA's device plugin keeps its config API (``api/config/v1``) apart from the code that talks to
the world: standard library and ``gpuguard.core`` only, never an adapter, the runtime, the
commands, the config or ``app``, and no third-party library (import-linter holds it). Every value
is hostile input of any type; no I/O, clock or logging.
"""
