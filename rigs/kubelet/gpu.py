"""The GPU side of the real-node test (tests/node): stand-in device nodes, the device plugin
(testbin/node/deviceplugin, built by scripts/ensure-node.sh as ``gpu-device-plugin``) and the
``nvidia`` runtime handler (rigs/kubelet/nvidia-container-runtime, a runc wrapper that brings the
NVML stand-in into containers that set ``NVIDIA_VISIBLE_DEVICES``, as NVIDIA's runtime does).

The kubelet's device-plugin directory does not follow ``--root-dir``: kubelet v1.37.2 creates its
registration socket at ``pluginapi.KubeletSocket`` (k8s.io/kubelet v0.37.2
pkg/apis/deviceplugin/v1beta1/constants.go:30-32, ``/var/lib/kubelet/device-plugins/``), used by
k8s.io/kubernetes v1.37.2 pkg/kubelet/cm/devicemanager/manager.go:135; the registration server
creates the directory (plugin/v1beta1/server.go:89) and removes every socket in it at start
(server.go:103, manager.go:191-222), and the checkpoint ``kubelet_internal_checkpoint`` lives
there too (manager.go:170-176). A plugin's socket must be in the same directory (the kubelet
dials ``<that dir>/<endpoint>``, server.go:176).
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
"""The kubelet's device-plugin directory, hard-coded (see the module docstring)."""
KUBELET_SOCKET = DEVICE_PLUGIN_DIR / "kubelet.sock"
PLUGIN_ENDPOINT = "gpuguard-test-gpu.sock"
"""The plugin's socket name in the device-plugin directory (its default ``--endpoint``)."""
PLUGIN_BINARY = "gpu-device-plugin"
"""The plugin's name in scripts/ensure-node.sh's ``NODE_BIN`` directory."""
RESOURCE = "nvidia.com/gpu"
UUID_PREFIX = "GPU-"
UUID_SUFFIX = "-1111-2222-3333-444444444444"
"""The plugin's default UUIDs: GPU i is ``GPU-<i as %08d>-1111-2222-3333-444444444444``, the
UUIDs of tests/nvml_stub/scenarios/h200x8.json."""

RUNTIME_SCRIPT = Path(__file__).with_name("nvidia-container-runtime")
RUNTIME_HANDLER = "nvidia"
"""The RuntimeClass handler (the chart's ``runtimeClassName: nvidia``, NVIDIA's name)."""
CONTAINER_LIBRARY = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
CONTAINER_SCENARIO_DIR = "/run/nvml-stub"
"""Where the runtime mounts the scenario directory; ``NVML_STUB_SCENARIO`` is
``<this>/scenario.json`` in the container."""
STANDIN_DEVICE = (1, 3)
"""major, minor of every stand-in device node: the null device under NVIDIA's names."""


# ---------------------------------------------------------------------------------------------
# Device nodes


def device_node_names(gpus: int) -> list[str]:
    """``nvidia0`` … ``nvidia<gpus-1>``, ``nvidiactl``, ``nvidia-uvm``."""
    return [*(f"nvidia{i}" for i in range(gpus)), "nvidiactl", "nvidia-uvm"]


def make_device_nodes(dev_dir: Path, gpus: int) -> list[Path]:
    """Create ``dev_dir`` (if absent) with a null device (``c 1 3``, mode 0666) under each of
    NVIDIA's names; an existing node of that kind is kept, anything else there is an error.
    Needs CAP_MKNOD and a filesystem mounted without ``nodev`` (checked first: on a nodev mount
    the nodes would be created and then refuse every open)."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    dev_dir.mkdir(parents=True, exist_ok=True)
    if os.statvfs(dev_dir).f_flag & os.ST_NODEV:
        raise RuntimeError(
            f"{dev_dir} is on a filesystem mounted nodev: device nodes there cannot be opened; "
            "put the stand-in device directory on one without nodev (e.g. the work directory)"
        )
    rdev = os.makedev(*STANDIN_DEVICE)
    made = []
    for name in device_node_names(gpus):
        path = dev_dir / name
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, rdev)
        except FileExistsError:
            st = os.lstat(path)
            if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev):
                raise FileExistsError(f"{path} exists and is not a c 1 3 device node") from None
        os.chmod(path, 0o666)  # mknod's mode is masked by the umask
        made.append(path)
    return made


# ---------------------------------------------------------------------------------------------
# The device plugin


def gpu_uuids(gpus: int, prefix: str = UUID_PREFIX, suffix: str = UUID_SUFFIX) -> list[str]:
    """The UUIDs the plugin gives its GPUs: ``<prefix><i as %08d><suffix>``."""
    return [f"{prefix}{i:08d}{suffix}" for i in range(gpus)]


def uuid_flags(uuids: Sequence[str]) -> tuple[str, str]:
    """``(prefix, suffix)`` for which ``gpu_uuids(len(uuids), prefix, suffix) == uuids``: how to
    ask the plugin for these UUIDs. ``ValueError`` when no split fits (GPU i's UUID must carry
    ``i`` as 8 decimal digits at one fixed place, e.g. ``GPU-5eb3a1a0-0000-4000-8000-000000000000``
    for GPU 0)."""
    if not uuids:
        raise ValueError("no UUIDs")
    first = uuids[0]
    start = first.find("00000000")
    while start >= 0:
        prefix, suffix = first[:start], first[start + 8 :]
        if gpu_uuids(len(uuids), prefix, suffix) == list(uuids):
            return prefix, suffix
        start = first.find("00000000", start + 1)
    raise ValueError(f"{list(uuids)}: GPU i's UUID must be <prefix><i as %08d><suffix>")


def advertised_device_ids(uuids: Sequence[str], replicas: int) -> list[str]:
    """The device IDs the plugin advertises, in its order: each UUID as it is with one replica
    (NVIDIA's plugin without sharing), else ``<uuid>::<k>`` for k in 0..replicas-1 (NVIDIA's
    time-slicing ``AnnotatedID``)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1:
        return list(uuids)
    return [f"{u}::{k}" for u in uuids for k in range(replicas)]


def allocation(
    device_ids: Sequence[str], uuids: Sequence[str], dev_dir: Path
) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """What the plugin's Allocate answers for one container asking for ``device_ids``: its env
    and its device specs ``(container path, host path, permissions)``."""
    indices: list[int] = []
    for device_id in device_ids:
        index = uuids.index(device_id.split("::", 1)[0])
        if index not in indices:
            indices.append(index)
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids[i] for i in indices)}
    names = [*(f"nvidia{i}" for i in indices), "nvidiactl", "nvidia-uvm"]
    return env, [(f"/dev/{n}", str(dev_dir / n), "rw") for n in names]


def device_plugin_argv(
    binary: Path,
    *,
    dev_dir: Path,
    uuids: Sequence[str],
    replicas: int,
    plugin_dir: Path = DEVICE_PLUGIN_DIR,
    resource: str = RESOURCE,
) -> list[str]:
    prefix, suffix = uuid_flags(uuids)
    return [
        str(binary),
        f"--kubelet-socket={plugin_dir / 'kubelet.sock'}",
        f"--plugin-dir={plugin_dir}",
        f"--endpoint={PLUGIN_ENDPOINT}",
        f"--resource={resource}",
        f"--gpus={len(uuids)}",
        f"--replicas={replicas}",
        f"--uuid-prefix={prefix}",
        f"--uuid-suffix={suffix}",
        f"--dev-dir={dev_dir}",
    ]


def start_device_plugin(
    binary: Path,
    plugin_dir: Path = DEVICE_PLUGIN_DIR,
    *,
    dev_dir: Path,
    log: Path,
    gpus: int = 1,
    replicas: int = 1,
    uuid: str | None = None,
    uuids: Sequence[str] | None = None,
    resource: str = RESOURCE,
) -> subprocess.Popen[bytes]:
    """Start the plugin (``binary``: ``<NODE_BIN>/gpu-device-plugin``) with its output appended to
    ``log``. ``plugin_dir`` is the kubelet's device-plugin directory, where kubelet.sock appears
    (the kubelet's is hard-coded: DEVICE_PLUGIN_DIR). GPUs: ``uuids``, or ``[uuid]``, or
    ``gpu_uuids(gpus)``. The plugin waits for kubelet.sock, registers, and registers again after a
    kubelet restart; stop it with SIGTERM (it removes its socket)."""
    if uuids is None:
        uuids = [uuid] if uuid is not None else gpu_uuids(gpus)
    argv = device_plugin_argv(
        binary,
        dev_dir=dev_dir,
        uuids=uuids,
        replicas=replicas,
        plugin_dir=plugin_dir,
        resource=resource,
    )
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(argv)}\n".encode())
        out.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


# ---------------------------------------------------------------------------------------------
# The nvidia runtime handler


def install_runtime(
    dest_dir: Path,
    *,
    runc: Path,
    library: Path,
    scenario_dir: Path,
    dev_dir: Path,
    gpu_uuids: Sequence[str] | None = None,
    log: Path | None = None,
    python: str = sys.executable,
) -> Path:
    """Copy rigs/kubelet/nvidia-container-runtime into ``dest_dir`` (its ``#!`` line naming
    ``python``, run isolated: ``-I``) with its configuration beside it
    (``nvidia-container-runtime.json``); the copy's path, for ``containerd_runtime_toml``.

    ``library``: the built stand-in (``make -C tests/nvml_stub``: tests/nvml_stub/build/
    libnvidia-ml.so.1). ``scenario_dir``: holds ``scenario.json`` (rewrite it atomically; the
    container sees the directory). ``gpu_uuids``: how NVIDIA_VISIBLE_DEVICES UUIDs map to
    ``nvidia<i>`` (default: the scenario's ``devices`` order). ``log``: one JSON line per runtime
    call (``action``: passthrough, unchanged, injected, refused)."""
    for path, what in ((runc, "runc"), (library, "NVML stand-in")):
        if not path.is_file():
            raise FileNotFoundError(f"{what} {path} not found")
    dest_dir.mkdir(parents=True, exist_ok=True)
    script = dest_dir / RUNTIME_SCRIPT.name
    text = RUNTIME_SCRIPT.read_text()
    first, _, rest = text.partition("\n")
    if not first.startswith("#!"):
        raise ValueError(f"{RUNTIME_SCRIPT}: no #! line")
    config: dict[str, object] = {
        "runc": str(runc.absolute()),
        "library": str(library.absolute()),
        "scenario_dir": str(scenario_dir.absolute()),
        "dev_dir": str(dev_dir.absolute()),
        "container_library": CONTAINER_LIBRARY,
        "container_scenario_dir": CONTAINER_SCENARIO_DIR,
    }
    if gpu_uuids is not None:
        config["gpu_uuids"] = list(gpu_uuids)
    if log is not None:
        config["log"] = str(log.absolute())
    script.with_name(script.name + ".json").write_text(json.dumps(config, indent=2) + "\n")
    tmp = script.with_name(f".{script.name}.tmp")
    tmp.write_text(f"#!{python} -I\n{rest}")
    tmp.chmod(0o755)
    tmp.replace(script)
    return script


def containerd_runtime_toml(
    shim_path: Path,
    *,
    handler: str = RUNTIME_HANDLER,
    runc_root: Path | None = None,
    disable_pause_image_pull: bool = True,
) -> str:
    """containerd 2.x (config ``version = 3``) CRI runtime handler ``handler`` running
    ``shim_path`` as runc, to append to the node's config.toml.

    Key names as containerd v2.4.2 reads them: the CRI runtime plugin is
    ``io.containerd.cri.v1.runtime`` (plugins/cri/runtime/plugin.go:48-49, plugins/types.go:77);
    ``containerd.runtimes.<handler>`` with ``runtime_type``, ``disable_pause_image_pull`` and
    ``options``, per handler (internal/cri/config/config.go:86, 99, 132, 147, 355); ``options``
    decode into the runc shim's options (config.go:745 GenerateRuntimeOptions; containerd api
    v1.12.0 types/runc/options/oci.pb.go: ``BinaryName``, ``Root``, ``SystemdCgroup``). ``Root``
    (runc's state) defaults to a ``runc-<handler>`` directory beside the shim: unset, the runc shim
    uses /run/containerd/runc/<namespace> (cmd/containerd-shim-runc-v2/process/utils.go:39)."""
    root = runc_root if runc_root is not None else shim_path.parent / f"runc-{handler}"
    table = f"plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}"
    return (
        f"\n[{table}]\n"
        f'  runtime_type = "io.containerd.runc.v2"\n'
        f"  disable_pause_image_pull = {'true' if disable_pause_image_pull else 'false'}\n"
        f"\n[{table}.options]\n"
        f"  BinaryName = {json.dumps(str(shim_path))}\n"
        f"  Root = {json.dumps(str(root))}\n"
        f"  SystemdCgroup = false\n"
    )
