"""A real Kubernetes node on this machine for tests: containerd, runc, the CNI bridge and a kubelet
registered with a ``rigs.controlplane.KubeCluster``, for the tests that need a real node.

Owns: one node's processes (containerd, kubelet: stopped by PID; the shims and pods they start:
found by our containerd's address in their command line and by the node's own cgroup tree,
signalled by pidfd), its work directory (containerd's root and state, the kubelet's root,
certificates, configs, logs), the few host paths the binaries hard-code (bind-mounted from the
work directory: the device-plugin directory, ``/var/log/containers``, libcni's cache), its own
cgroup root (``gpuguard-node-<id>`` at the top of every hierarchy, the kubelet's ``cgroupRoot``:
the pods' ``kubepods`` tree lives below it), its own network namespace (pinned at
``<work dir>/netns``, rigs/kubelet/netns.py: containerd and the kubelet run in it, so the CNI
bridge, the pods' veths and addresses, the node's InternalIP and the ``kubernetes`` Service's
ClusterIP exist only there, and the relays across it), and the kernel tunables the kubelet
rewrites (restored). ``close`` removes all of it, also after a failed start; a crashed run's
leftovers are removed by the next start (``reap_leftovers``, keyed by a marker file written before
anything is created). One node at a time per machine (a lock: the hard-coded host paths are
shared).

Must not: touch a process, mount, cgroup or interface that is not the node's (another kubelet's
``kubepods``, someone's ``cni0``); add an address, route or link to the host's network
namespace; leave anything in ``/var/lib``, ``/run``, ``/var/log`` or the cgroup tree.
``RealNode.leftovers`` judges only what this node made, never the rest of the host.

Also here: ``ensure_node_binaries`` (scripts/ensure-node.sh, or ``NODE_BIN``), the pause image
(``rigs/kubelet/pause.c``, static) and a busybox image (Debian's busybox-static), both packed by
scripts/rootfs_to_oci.py into OCI archives that ``ctr images import`` accepts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from rigs.controlplane import (
    AdminRequestError,
    KubeCluster,
    key_pem,
    log_tail,
    script_output,
    signed_by,
    spawn_logged,
    terminate,
    write_kubeconfig,
    write_private,
)
from rigs.kubelet.netns import NODE_IP, NodeNetwork, pinned, unpin

REPO = Path(__file__).resolve().parents[2]
NODE_ENSURE_COMMAND = "scripts/ensure-node.sh"
NODE_BINARIES = ("kubelet", "containerd", "ctr", "containerd-shim-runc-v2", "runc")
CNI_PLUGINS = ("bridge", "host-local", "loopback")

MARKER_ROOT = Path("/tmp/gpuguard-realnode")
"""Markers of live or crashed nodes, the machine lock, and the shims' socket directories (a
containerd ``socket_dir`` must be short: 42 characters at most, containerd v2.4.2
core/runtime/v2/socket_linux.go)."""
NAMESPACE = "k8s.io"
"""containerd's namespace for the CRI plugin's containers and images."""
CGROUP_PARENT = "kubepods"
"""The kubelet's pod cgroup parent (cgroupfs driver), below the node's own cgroup root."""
CGROUP_ROOT_PREFIX = "gpuguard-node-"
"""A node's cgroup root, ``<prefix><id>`` at the top of every hierarchy (the kubelet's
``cgroupRoot``): a plain directory name, neither ``.slice`` nor a unit, so gpuguard's cgroup
parser reads the ``kubepods`` below it as the kubelet's (core/cgroup.py)."""
BRIDGE = "cni0"
"""The CNI bridge, inside the node's network namespace (so the name is free in every run)."""
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
"""The kubelet's ports, inside the node's network namespace (free there in every run)."""
POD_SUBNET = "10.88.0.0/16"
HOST_DIRS = {
    # kubelet v1.37.2 pkg/kubelet/cm/devicemanager/manager.go: the device-plugin socket
    # directory is pluginapi.DevicePluginPath, hard-coded (it does not follow --root-dir).
    "device-plugins": Path("/var/lib/kubelet/device-plugins"),
    # kubelet.go ContainerLogsDir: the legacy per-container log symlinks, hard-coded.
    "container-logs": Path("/var/log/containers"),
    # libcni's CacheDir (containernetworking/cni v1.3.1 libcni/api.go); go-cni never sets it.
    "cni-cache": Path("/var/lib/cni"),
}
"""Host paths the binaries hard-code, each bind-mounted from the work directory while the node
runs (created first when absent, and removed again)."""
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
"""What the kubelet rewrites at start unless protectKernelDefaults (container_manager_linux.go
setupKernelTunables): recorded before and restored after."""
PAUSE_REF = "localhost/gpuguard-test/pause:1"
BUSYBOX_REF = "localhost/gpuguard-test/busybox:1"
BUSYBOX_APPLETS = ("sh", "sleep", "cat", "echo", "ls", "kill", "true", "env", "ps")

_MS_BIND = 4096
_MNT_DETACH = 2


# ---------------------------------------------------------------------------------------------
# Binaries and images


def _node_bin_in(d: Path, source: str) -> tuple[Path | None, str | None]:
    paths = [d / n for n in NODE_BINARIES] + [d / "cni" / n for n in CNI_PLUGINS]
    missing = [str(p) for p in paths if not os.access(p, os.X_OK)]
    if missing:
        return None, f"missing {', '.join(missing)} ({source})"
    return d, None


def ensure_node_binaries(timeout: float = 3600.0) -> tuple[Path | None, str | None]:
    """Run ``scripts/ensure-node.sh`` (cached: a hash and the ``--version`` calls; cold, ~10 min
    of builds) and return ``(dir, None)`` (binaries in it, CNI plugins in ``dir/cni``), or
    ``(None, why)``. ``NODE_BIN=<dir>`` names prebuilt binaries instead (no Go needed)."""
    prebuilt = os.environ.get("NODE_BIN")
    if prebuilt:
        return _node_bin_in(Path(prebuilt), "NODE_BIN")
    lines, why = script_output(
        NODE_ENSURE_COMMAND, prefix="NODE_BIN=", runner=["bash"], timeout=timeout
    )
    if lines is None:
        return None, why
    return _node_bin_in(Path(lines[-1].removeprefix("NODE_BIN=")), f"after {NODE_ENSURE_COMMAND}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalImage:
    """An OCI archive (``ctr images import`` accepts it) and the image name it carries."""

    archive: Path
    ref: str


def _image_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    d = base / "gpuguard-node-images"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _tar_add(tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
             kind: bytes = tarfile.REGTYPE, link: str = "") -> None:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0
    info.uid = info.gid = 0
    info.linkname = link
    info.size = len(data) if data is not None else 0
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _pack(files: dict[str, bytes], links: dict[str, str], ref: str, cmd: Sequence[str],
          out: Path, env: Sequence[str] = ()) -> None:  # fmt: skip
    """A rootfs tar of ``files`` (path → content, executable) and ``links`` (path → target),
    made an OCI layout and archive by scripts/rootfs_to_oci.py, renamed to ``out`` last."""
    with tempfile.TemporaryDirectory(prefix=".pack.", dir=out.parent) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        with tarfile.open(rootfs, "w", format=tarfile.PAX_FORMAT) as tar:
            dirs = sorted({str(Path(p).parent) for p in [*files, *links]} - {"."})
            for d in dirs:
                _tar_add(tar, d, kind=tarfile.DIRTYPE)
            for path, data in sorted(files.items()):
                _tar_add(tar, path, data=data)
            for path, target in sorted(links.items()):
                _tar_add(tar, path, kind=tarfile.SYMTYPE, link=target, mode=0o777)
        layout, scratch = Path(tmp) / "layout", Path(tmp) / "archive.tar"
        argv = [str(REPO / "scripts" / "rootfs_to_oci.py"), str(rootfs), str(layout)]
        argv += ["--name", ref, "--archive", str(scratch), *[f"--cmd={c}" for c in cmd]]
        argv += [f"--env={e}" for e in env]
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"rootfs_to_oci.py {ref}: {done.stdout}{done.stderr}")
        scratch.rename(out)


def _key(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def pause_image() -> LocalImage:
    """The sandbox image: rigs/kubelet/pause.c built static, cached under ~/.cache keyed by the
    source, the packer and the compiler."""
    source = Path(__file__).with_name("pause.c")
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, check=True).stdout
    packer = (REPO / "scripts" / "rootfs_to_oci.py").read_bytes()
    key = _key(source.read_bytes(), packer, gcc, PAUSE_REF.encode(), Path(__file__).read_bytes())
    out = _image_cache() / f"pause-{key}.oci.tar"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "pause"
            subprocess.run(
                ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(source)],
                check=True,
                capture_output=True,
            )
            _pack({"pause": binary.read_bytes()}, {}, PAUSE_REF, ["/pause"], out)
    return LocalImage(archive=out, ref=PAUSE_REF)


def busybox_image() -> LocalImage:
    """Debian's busybox-static (``apt-get download``, verified by apt) as ``/bin/busybox`` plus
    applet links, cached under ~/.cache keyed by the package version and the packer."""
    policy = subprocess.run(
        ["apt-cache", "policy", "busybox-static"], capture_output=True, text=True, check=True
    ).stdout
    version = next(
        (ln.split(":", 1)[1].strip() for ln in policy.splitlines() if "Candidate:" in ln), ""
    )
    if not version or version == "(none)":
        raise RuntimeError(f"apt knows no busybox-static candidate:\n{policy}")
    packer = (REPO / "scripts" / "rootfs_to_oci.py").read_bytes()
    key = _key(version.encode(), packer, BUSYBOX_REF.encode(), Path(__file__).read_bytes())
    out = _image_cache() / f"busybox-{key}.oci.tar"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                ["apt-get", "download", f"busybox-static={version}"],
                cwd=tmp,
                check=True,
                capture_output=True,
            )
            deb = next(Path(tmp).glob("busybox-static_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/root"], check=True)
            binary = (Path(tmp) / "root" / "bin" / "busybox").read_bytes()
            links = {f"bin/{a}": "busybox" for a in BUSYBOX_APPLETS}
            _pack({"bin/busybox": binary}, links, BUSYBOX_REF, ["/bin/sh"], out, ["PATH=/bin"])
    return LocalImage(archive=out, ref=BUSYBOX_REF)


def archive_names(archive: Path) -> list[str]:
    """The image names an OCI archive's index.json carries (what ``ctr images import`` names
    them when they are full references)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        index = json.loads(member.read())
    names = []
    for m in index.get("manifests", []):
        ann = m.get("annotations") or {}
        name = ann.get("io.containerd.image.name") or ann.get("org.opencontainers.image.ref.name")
        if name:
            names.append(name)
    return names


# ---------------------------------------------------------------------------------------------
# Host state: processes, mounts, cgroups, links


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _self_and_ancestors() -> set[int]:
    pids = {0}
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def processes_mentioning(needles: Iterable[str]) -> dict[int, str]:
    """``{pid: cmdline}`` of every process (not this one or its ancestors) whose command line
    contains one of ``needles``."""
    wanted = [n for n in needles if n]
    skip = _self_and_ancestors()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        line = _cmdline(int(entry.name))
        if any(n in line for n in wanted):
            found[int(entry.name)] = line
    return found


def signal_verified(pid: int, check: Any, sig: int = signal.SIGKILL) -> bool:
    """Signal ``pid`` through a pidfd, after ``check(pid)`` confirms (with the pidfd open, so
    the PID cannot be reused under us) it is still the process we mean."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not check(pid):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def cgroup_mounts() -> list[Path]:
    """Every cgroup (v1) and cgroup2 mount point of this mount namespace."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in ("cgroup", "cgroup2"):
            found.append(Path(_unescape(left.split()[4])))
    return found


def cgroup_dirs(root: str) -> list[Path]:
    """The node's cgroup root ``root`` in every hierarchy where it exists."""
    if not root:
        return []
    return sorted(m / root for m in cgroup_mounts() if (m / root).is_dir())


def make_cgroup_root(root: str) -> None:
    """``root`` at the top of every hierarchy (the kubelet refuses a ``cgroupRoot`` that does not
    exist); in the v1 cpuset hierarchy with the top's CPUs and memory nodes (a new cpuset
    cgroup starts with none)."""
    for mount in cgroup_mounts():
        d = mount / root
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).exists() and not (d / name).read_text().strip():
                (d / name).write_text((mount / name).read_text())


def _cgroup_tree_pids(roots: Sequence[Path]) -> set[int]:
    pids: set[int] = set()
    for root in roots:
        for d, _, _ in os.walk(root):
            with contextlib.suppress(OSError, ValueError):
                text = (Path(d) / "cgroup.procs").read_text()
                pids.update(int(x) for x in text.split())
    return pids


def _in_cgroup_root(root: str) -> Any:
    """A check for ``signal_verified``: the process is below ``/<root>`` in some hierarchy."""

    def check(pid: int) -> bool:
        try:
            text = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        lines = text.splitlines()
        return any((ln.split(":", 2)[2] + "/").startswith(f"/{root}/") for ln in lines)

    return check


def _kill_cgroup_tree(root: str, deadline_seconds: float = 15.0) -> list[str]:
    """SIGKILL every process below the node's cgroup root ``root`` (pods' containers and pause
    processes), until none is left; then remove its cgroups, deepest first. Returns what could
    not be removed. Nothing outside ``root`` is looked at."""
    if not root:
        return []
    deadline = time.monotonic() + deadline_seconds
    in_root = _in_cgroup_root(root)
    while True:
        pids = _cgroup_tree_pids(cgroup_dirs(root))
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            signal_verified(pid, in_root)
        time.sleep(0.1)
    problems = [f"process {p} still in {root}: {_cmdline(p)!r}" for p in sorted(pids)]
    for top in cgroup_dirs(root):
        for d, _, _ in os.walk(top, topdown=False):
            for _attempt in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                problems.append(f"cgroup {d} not removable")
    return problems


def _unescape(field_: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def mounts_under(roots: Iterable[Path]) -> list[Path]:
    """Mount points at or below any of ``roots``, deepest (and latest) first."""
    prefixes = [str(r).rstrip("/") for r in roots]
    found: list[tuple[int, int, Path]] = []
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    for order, line in enumerate(lines):
        point = _unescape(line.split()[4])
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append((point.count("/"), order, Path(point)))
    return [p for _, _, p in sorted(found, reverse=True)]


def _umount(path: Path) -> str | None:
    libc = _libc()
    for flags in (0, _MNT_DETACH):
        if libc.umount2(str(path).encode(), flags) == 0:
            return None
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):  # not a mount (any more)
            return None
        if err != errno.EBUSY:
            return f"umount {path}: {os.strerror(err)}"
    return f"umount {path}: busy"


def _unmount_all(roots: Iterable[Path]) -> list[str]:
    problems = []
    roots = list(roots)
    for _round in range(5):
        points = mounts_under(roots)
        if not points:
            return []
        problems = [p for p in (_umount(m) for m in points) if p]
    return problems + [f"still mounted: {m}" for m in mounts_under(roots)]


def _bind(src: Path, dst: Path) -> None:
    if _libc().mount(str(src).encode(), str(dst).encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind mount {src} on {dst}: {os.strerror(err)}")


def _read_sysctls() -> dict[str, str]:
    values = {}
    for name in KUBELET_SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = (Path("/proc/sys") / name).read_text().strip()
    return values


def _restore_sysctls(values: dict[str, str]) -> list[str]:
    problems = []
    for name, value in values.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as e:
            problems.append(f"sysctl {name}={value}: {e}")
    return problems


# ---------------------------------------------------------------------------------------------
# Markers: what a node created, written before it is created, for the next run's reaper


@dataclass(slots=True, kw_only=True)
class Marker:
    workdir: str
    socket_dir: str
    cgroup_root: str = ""
    netns: str = ""
    created_dirs: list[str] = field(default_factory=list)
    binds: list[str] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)
    owner_pid: int = 0

    def save(self, path: Path) -> None:
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        scratch.rename(path)

    @staticmethod
    def load(path: Path) -> Marker:
        return Marker(**json.loads(path.read_text()))


def _teardown(marker: Marker, *, containerd: Any = None, kubelet: Any = None) -> list[str]:
    """Everything a node made, undone in order; also for a crashed run's marker (then the
    processes are found by the work directory in their command line). Returns the problems."""
    problems: list[str] = []
    workdir = Path(marker.workdir)
    if not workdir.is_absolute() or len(workdir.parts) < 3:
        return [f"refusing to tear down a node whose work directory is {workdir}"]
    needles = [str(workdir) + "/"]
    # 1. The kubelet first (it would restart what we kill).
    terminate(kubelet)
    for pid, line in processes_mentioning(needles).items():
        if "kubelet" in line.split(" ", 1)[0]:
            signal_verified(pid, lambda p: any(n in _cmdline(p) for n in needles))
    # 2. Every pod process (containers, pause), while the shims still reap them.
    problems += [p for p in _kill_cgroup_tree(marker.cgroup_root) if p.startswith("process")]
    # 3. containerd, then its shims (our address is in their command line), then anything else
    #    started with our work directory in its arguments.
    terminate(containerd)
    for _attempt in range(50):
        left = processes_mentioning(needles)
        if not left:
            break
        for pid in left:
            signal_verified(pid, lambda p: any(n in _cmdline(p) for n in needles))
        time.sleep(0.1)
    problems += [f"process {p} left: {c!r}" for p, c in processes_mentioning(needles).items()]
    # 4. Mounts: the host-path binds, then everything under the work directory (rootfs
    #    overlays, sandbox shm, network namespaces, pod volumes, the kubelet's rshared root).
    problems += _unmount_all([Path(b) for b in marker.binds])
    problems += _unmount_all([workdir])
    # 5. The node's cgroups (empty now), its network namespace (the bridge and the pods' veth
    #    ends go with it once the relays' sockets close).
    problems += _kill_cgroup_tree(marker.cgroup_root, deadline_seconds=5.0)
    problems += unpin(Path(marker.netns)) if marker.netns else []
    # 6. Host directories we created, deepest first, once nothing is mounted on them.
    for d in sorted(marker.created_dirs, key=lambda p: p.count("/"), reverse=True):
        path = Path(d)
        if mounts_under([path]):
            problems.append(f"{d} still has mounts: not removed")
            continue
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    problems += _restore_sysctls(marker.sysctls)
    shutil.rmtree(marker.socket_dir, ignore_errors=True)
    # 7. The bulky state (snapshots, pod dirs), only when nothing under it is mounted; logs,
    #    configs and certificates stay for the test's report.
    if not mounts_under([workdir]):
        for sub in ("containerd", "kubelet", "device-plugins", "cni-cache", "container-logs"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
    return problems


@contextlib.contextmanager
def _machine_lock(timeout: float = 900.0) -> Iterator[int]:
    MARKER_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(MARKER_ROOT / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another real node holds {MARKER_ROOT}/.lock") from None
                time.sleep(1)
        yield fd
    finally:
        os.close(fd)


def reap_leftovers(marker_root: Path = MARKER_ROOT) -> list[str]:
    """Undo what crashed runs left (each marker under ``marker_root`` whose owner is gone);
    call with the machine lock held. Returns the problems (empty: all removed)."""
    problems = []
    for path in sorted(marker_root.glob("node-*.json")):
        try:
            marker = Marker.load(path)
        except (OSError, ValueError, TypeError) as e:
            problems.append(f"{path}: unreadable marker: {e}")
            continue
        if marker.owner_pid and marker.owner_pid != os.getpid() and _alive(marker.owner_pid):
            continue  # a live node of another process (the lock makes this rare)
        left = _teardown(marker)
        problems += left
        if not left:
            path.unlink(missing_ok=True)
    return problems


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def node_leftovers(marker: Marker) -> list[str]:
    """What the node of ``marker`` made and is still there (empty: nothing): processes and
    mounts of its work directory, its host-path binds and the host directories it created, its
    cgroup root, its network namespace, its shims' socket directory. Nothing else on the host
    is judged: another process's cgroups, links or mounts are not this node's leftovers."""
    workdir = Path(marker.workdir)
    found = [f"process {p}: {c}" for p, c in processes_mentioning([f"{workdir}/"]).items()]
    mounts = mounts_under([workdir, *map(Path, marker.binds)])
    found += [f"mount {m}" for m in mounts if str(m) != marker.netns]  # the pin: below
    found += [d for d in marker.created_dirs if Path(d).exists() or Path(d).is_symlink()]
    found += [f"cgroup {d}" for d in cgroup_dirs(marker.cgroup_root)]
    if marker.netns and pinned(Path(marker.netns)):
        found.append(f"netns {marker.netns}")
    if Path(marker.socket_dir).exists():
        found.append(marker.socket_dir)
    return found


SNAPSHOT_DIRS = ("/etc", "/opt", "/run", "/var/run", "/var/lib", "/var/log", "/usr/libexec",
                 "/var/run/netns")  # fmt: skip
"""Where a node's binaries could write by a hard-coded path (a missed one shows here). Not the
cgroup tree, the links or ``/dev/shm``: other processes on a busy machine change those all the
time, and the node's own there are known by name (``node_leftovers``)."""


def host_snapshot() -> set[str]:
    """The entries (two levels deep) of the host directories a node could write to: compare one
    taken before a node with one taken after its ``close``."""
    found: set[str] = set()
    for top in SNAPSHOT_DIRS:
        root = Path(top)
        with contextlib.suppress(OSError):
            for child in root.iterdir():
                found.add(str(child))
                if child.is_dir() and not child.is_symlink():
                    with contextlib.suppress(OSError):
                        found.update(str(c) for c in child.iterdir())
    return found


# ---------------------------------------------------------------------------------------------
# The node


def node_id(workdir: Path) -> str:
    """A node's id, from its work directory: its cgroup root's and its marker's name."""
    return hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:10]


def marker_path(workdir: Path) -> Path:
    """Where the node of ``workdir`` records what it made (``Marker``) while it lives."""
    return MARKER_ROOT / f"node-{node_id(workdir)}.json"


class RealNode:
    """containerd + kubelet registered with ``cluster`` as Node ``name``; a context manager.

    ``start`` returns when the Node is Ready (on failure it closes everything and raises with
    the logs' tails); ``close`` is idempotent and leaves nothing behind (module docstring).
    """

    def __init__(
        self,
        cluster: KubeCluster,
        workdir: Path,
        node_bin: Path,
        *,
        name: str = "gpu-node-1",
        extra_runtimes_toml: str = "",
    ) -> None:
        self.cluster = cluster
        self.dir = workdir.resolve()
        self.bin = node_bin
        self.name = name
        self.extra_runtimes_toml = extra_runtimes_toml
        self.ip = ""
        self.kubelet_root = self.dir / "kubelet"
        self.containerd_address = str(self.dir / "containerd.sock")
        self.pause = pause_image()
        self.ready_seconds: float | None = None
        self._id = node_id(self.dir)
        self._marker_path = marker_path(self.dir)
        self.cgroup_root = f"{CGROUP_ROOT_PREFIX}{self._id}"
        self.netns = self.dir / "netns"
        self.network: NodeNetwork | None = None
        self._marker = Marker(
            workdir=str(self.dir),
            socket_dir=str(MARKER_ROOT / f"s-{self._id}"),
            cgroup_root=self.cgroup_root,
            netns=str(self.netns),
        )
        self._lock: contextlib.ExitStack | None = None
        self._containerd: subprocess.Popen[bytes] | None = None
        self._kubelet: subprocess.Popen[bytes] | None = None
        self._closed = True

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        self._closed = False
        try:
            self._start()
        except BaseException as e:
            problems = self._close()
            raise RuntimeError(
                f"node {self.name} did not start: {e}\n"
                + (f"cleanup problems: {problems}\n" if problems else "")
                + self.logs()
            ) from e
        self.ready_seconds = time.monotonic() - t0

    def _start(self) -> None:
        lock = contextlib.ExitStack()
        lock.enter_context(_machine_lock())
        self._lock = lock  # only a node holding the lock tears anything down
        problems = reap_leftovers()
        if problems:
            raise RuntimeError(f"a previous node's leftovers could not be removed: {problems}")
        # Nothing of another's can collide: the cgroup root and the network namespace are this
        # node's own names (another kubelet's kubepods, someone's cni0 are left alone).
        if self.cluster.egress_socket is None:
            raise RuntimeError(
                "the cluster has no node egress (KubeCluster(node_egress=True)): "
                "its API server could not reach a kubelet in the node's netns"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self._marker.owner_pid = os.getpid()
        self._marker.sysctls = _read_sysctls()
        self._marker.save(self._marker_path)
        make_cgroup_root(self.cgroup_root)
        self.ip = NODE_IP
        self.network = NodeNetwork(
            self.netns,
            apiserver_port=self.cluster.apiserver_port,
            egress_socket=self.cluster.egress_socket,
        )
        self.network.start()
        self._host_dirs()
        self._write_configs()
        self._start_containerd()
        self.import_image(self.pause.archive)
        self._forget_node()  # a stale Node of this name would read Ready before we are
        self._start_kubelet()
        self._wait_ready(timeout=180.0)

    def close(self) -> None:
        problems = self._close()
        if problems:
            raise RuntimeError(f"node {self.name} left things behind: {problems}")

    def _close(self) -> list[str]:
        if self._closed:
            return []
        self._closed = True
        problems: list[str] = []
        if self._lock is None:  # never locked: nothing of ours exists, another node's may
            return []
        try:
            problems = _teardown(self._marker, containerd=self._containerd, kubelet=self._kubelet)
            if self.network is not None:
                problems += self.network.close()  # the relays: the namespace goes with them
            with contextlib.suppress(AdminRequestError, OSError):
                self._forget_node()  # the API server may be gone already
            if not problems:
                self._marker_path.unlink(missing_ok=True)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None
        return problems

    def leftovers(self) -> list[str]:
        """What this node made and is still on the machine, its marker included (empty after a
        clean ``close``); never another process's cgroups, links or mounts."""
        found = node_leftovers(self._marker)
        if self._marker_path.exists():
            found.append(str(self._marker_path))
        return found

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- setup ---------------------------------------------------------------------------------

    def _host_dirs(self) -> None:
        """Bind a work-directory folder onto each hard-coded host path (module HOST_DIRS),
        creating the path (and its missing parents) first and recording what we created."""
        for sub, target in HOST_DIRS.items():
            src = self.dir / sub
            src.mkdir(parents=True, exist_ok=True)
            missing = []
            p = target
            while not p.exists():
                missing.append(p)
                p = p.parent
            for d in reversed(missing):
                self._marker.created_dirs.append(str(d))
                self._marker.save(self._marker_path)
                d.mkdir(mode=0o755)
            self._marker.binds.append(str(target))
            self._marker.save(self._marker_path)
            _bind(src, target)

    def _certs(self) -> dict[str, Path]:
        pki = self.cluster.pki
        ca = x509.load_pem_x509_certificate(pki["ca.crt"].read_bytes())
        ca_key = serialization.load_pem_private_key(pki["ca.key"].read_bytes(), password=None)
        d = self.dir / "pki"
        d.mkdir(exist_ok=True)
        client, client_key = signed_by(
            ca,
            ca_key,
            f"system:node:{self.name}",
            orgs=["system:nodes"],
            eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
        )
        serving, serving_key = signed_by(
            ca,
            ca_key,
            f"system:node:{self.name}",
            orgs=["system:nodes"],
            eku=[ExtendedKeyUsageOID.SERVER_AUTH],
            ips=[self.ip, "127.0.0.1"],
            dns=[self.name, "localhost"],
        )
        files = write_private(
            d,
            {
                "kubelet.crt": serving.public_bytes(serialization.Encoding.PEM),
                "kubelet.key": key_pem(serving_key),
            },
        )
        write_kubeconfig(
            self.dir / "kubelet.kubeconfig",
            self.cluster.server,
            pki["ca.crt"].read_bytes(),
            cert=client.public_bytes(serialization.Encoding.PEM),
            key=key_pem(client_key),
        )
        return files

    def _write_configs(self) -> None:
        for sub in ("containerd/root", "containerd/state", "containerd/opt", "runc", "cni-conf",
                    "cni-ipam", "pod-logs", "volume-plugins", "kubelet"):  # fmt: skip
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        Path(self._marker.socket_dir).mkdir(mode=0o700, exist_ok=True)
        cni = {
            "cniVersion": "1.0.0",
            "name": "gpuguard-test",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,  # no iptables on this machine kind
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.dir / "cni-ipam"),
                    },
                },
                {"type": "loopback"},
            ],
        }
        (self.dir / "cni-conf" / "10-gpuguard-test.conflist").write_text(json.dumps(cni, indent=1))
        (self.dir / "containerd.toml").write_text(self._containerd_toml())
        certs = self._certs()
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": KUBELET_HEALTHZ_PORT,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cluster.pki["ca.crt"])},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(certs["kubelet.crt"]),
            "tlsPrivateKeyFile": str(certs["kubelet.key"]),
            "containerRuntimeEndpoint": f"unix://{self.containerd_address}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "failCgroupV1": False,  # this machine kind is cgroup v1 (1.35+ refuses it otherwise)
            "failSwapOn": False,
            "registerNode": True,
            "podPidsLimit": -1,
            "podLogsDir": str(self.dir / "pod-logs"),
            "volumePluginDir": str(self.dir / "volume-plugins"),
            # The disk may be mostly used: evict and collect images only when truly out.
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "resolvConf": "/etc/resolv.conf",
        }
        (self.dir / "kubelet.yaml").write_text(json.dumps(kubelet, indent=1))  # JSON is YAML

    def _containerd_toml(self) -> str:
        d = self.dir
        q = json.dumps  # a TOML basic string is a JSON string for these paths
        return f"""version = 3
root = {q(str(d / "containerd/root"))}
state = {q(str(d / "containerd/state"))}
temp = {q(str(d / "containerd/tmp"))}

[grpc]
  address = {q(self.containerd_address)}

[plugins.'io.containerd.internal.v1.opt']
  path = {q(str(d / "containerd/opt"))}

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.shim.v1.manager']
  socket_dir = {q(self._marker.socket_dir)}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {q(self.pause.ref)}

[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: the pause container's oom_score_adj -998 is refused otherwise
  # (runc: "can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{q(str(self.bin / "cni"))}]
  conf_dir = {q(str(d / "cni-conf"))}
  max_conf_num = 1

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  disable_pause_image_pull = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = {q(str(self.bin / "runc"))}
  Root = {q(str(d / "runc"))}
  SystemdCgroup = false
{self.extra_runtimes_toml}
"""

    def _in_netns(self, argv: list[str]) -> list[str]:
        """``argv`` run in the node's network namespace (nsenter execs it: the PID and the
        command line stay the binary's own)."""
        assert self.network is not None
        return ["nsenter", f"--net={self.network.path}", "--", *argv]

    def _env(self) -> dict[str, str]:
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        return {"PATH": f"{self.bin}:{path}", "HOME": str(self.dir)}

    def _start_containerd(self) -> None:
        log = self.dir / "containerd.log"
        self._containerd = spawn_logged(
            self._in_netns(
                [str(self.bin / "containerd"), "--config", str(self.dir / "containerd.toml")]
            ),
            log,
            self._env(),
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._containerd.poll() is not None:
                raise RuntimeError(f"containerd exited {self._containerd.returncode}")
            if Path(self.containerd_address).is_socket() and self.ctr("version").returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError("containerd did not answer within 60 s")

    def _start_kubelet(self) -> None:
        self._kubelet = spawn_logged(
            self._in_netns(
                [
                    str(self.bin / "kubelet"),
                    f"--config={self.dir / 'kubelet.yaml'}",
                    f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
                    f"--root-dir={self.kubelet_root}",
                    f"--cert-dir={self.dir / 'pki'}",
                    f"--hostname-override={self.name}",
                    f"--node-ip={self.ip}",
                    "--v=1",
                ]
            ),
            self.dir / "kubelet.log",
            self._env(),
        )

    def _forget_node(self) -> None:
        """Delete the Node object of this name, if any (a kubelet never deletes its own)."""
        try:
            self.cluster.admin_request("DELETE", f"/api/v1/nodes/{self.name}")
        except AdminRequestError as e:
            if e.code != 404:
                raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "not registered"
        while time.monotonic() < deadline:
            for name, proc in (("containerd", self._containerd), ("kubelet", self._kubelet)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}")
            try:
                node = self.cluster.admin_request("GET", f"/api/v1/nodes/{self.name}")
                conds = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
                ready = conds.get("Ready", {})
                if ready.get("status") == "True":
                    return
                last = f"Ready={ready.get('status')}: {ready.get('message')}"
            except AdminRequestError as e:
                last = str(e)
            time.sleep(0.5)
        raise TimeoutError(f"Node {self.name} not Ready after {timeout} s: {last}")

    # -- use -----------------------------------------------------------------------------------

    def ctr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``ctr --address <ours> -n k8s.io ARGS`` (not checked)."""
        return subprocess.run(
            [str(self.bin / "ctr"), "--address", self.containerd_address, "-n", NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self._env(),
        )

    def import_image(self, oci_tar: Path) -> list[str]:
        """``ctr images import`` an OCI archive; returns the names it now has in containerd."""
        done = self.ctr("images", "import", str(oci_tar), timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {oci_tar}: {done.stdout}{done.stderr}")
        present = set(self.ctr("images", "ls", "-q").stdout.split())
        names = [n for n in archive_names(oci_tar) if n in present]
        if not names:
            raise RuntimeError(
                f"ctr imported {oci_tar} under no name it carries ({archive_names(oci_tar)}); "
                f"present: {sorted(present)}\n{done.stdout}"
            )
        return names

    def container_host_pids(self, pod_uid: str, container_id: str) -> list[int]:
        """The host PIDs in a container's cgroup (kubelet's cgroupfs layout below the node's
        root: ``/<root>/kubepods[/<qos>]/pod<uid>/<id>``), read from the real cgroup tree."""
        cid = container_id.split("://", 1)[-1]
        for mount in cgroup_mounts():
            for qos in ("", "burstable/", "besteffort/"):
                pod = mount / self.cgroup_root / CGROUP_PARENT / f"{qos}pod{pod_uid}"
                procs = pod / cid / "cgroup.procs"
                with contextlib.suppress(OSError):
                    return sorted(int(p) for p in procs.read_text().split())
        return []

    def logs(self, n: int = 3000) -> str:
        """The tails of containerd's and the kubelet's logs, for a failing assertion."""
        return "\n".join(
            f"== {name}\n{log_tail(self.dir / f'{name}.log', n)}"
            for name in ("containerd", "kubelet")
        )
