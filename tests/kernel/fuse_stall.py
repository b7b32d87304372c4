"""A FUSE file system whose daemon a test stops: a tenant's file that blocks whoever asks its
file system for something it has not cached, for as long as the tenant likes.

Owns: the daemon (``python -m tests.kernel.fuse_stall MOUNTPOINT``: speaks the FUSE protocol over
``/dev/fuse`` itself, stdlib only, no libfuse; one regular file ``f`` in the root, attributes
never cached by the kernel, so every plain ``stat`` asks the daemon) and ``fuse_mount``, a
context manager that mounts it in a temporary directory and, however the test ends, kills the
daemon (a stopped one too: pending requests then fail and every blocked caller returns) and
detaches the mount.

Must not: signal any process but its own daemon, or mount anywhere but the directory given.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rigs.prereq import require

_IN_HEADER = struct.Struct("=IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
_OUT_HEADER = struct.Struct("=IiQ")  # len error unique
_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")  # struct fuse_attr, 88 bytes
_ENTRY_TIMES = struct.Struct("=QQQQII")  # nodeid generation entry_valid attr_valid (+nsec)
_ATTR_TIMES = struct.Struct("=QII")  # attr_valid attr_valid_nsec dummy
_OPEN_OUT = struct.Struct("=QIi")  # fh open_flags backing_id
_INIT_OUT = struct.Struct("=IIIIHHIIHHII")  # the leading fields of struct fuse_init_out
_INIT_OUT_BYTES = 64
_LOOKUP, _FORGET, _GETATTR, _OPEN, _RELEASE, _INIT = 1, 2, 3, 14, 18, 26
_OPENDIR, _RELEASEDIR, _INTERRUPT, _BATCH_FORGET = 27, 29, 36, 42
_ROOT, _FILE = 1, 2
FILE_NAME = "f"
READY = "mounted"


def _attr(node: int) -> bytes:
    mode = 0o40755 if node == _ROOT else 0o100644
    return _ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def serve(mountpoint: str) -> None:
    """Mount on ``mountpoint`` and answer until unmounted. Attribute and entry validity are
    0 s: the kernel keeps what it was told, but treats it as stale at once."""
    libc = ctypes.CDLL(None, use_errno=True)
    fuse = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    options = f"fd={fuse},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    ms_nosuid, ms_nodev = 0x2, 0x4
    if libc.mount(b"fuse-stall", mountpoint.encode(), b"fuse.stall", ms_nosuid | ms_nodev, options):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), mountpoint)
    print(READY, flush=True)

    def reply(unique: int, body: bytes = b"", error: int = 0) -> None:
        os.write(fuse, _OUT_HEADER.pack(_OUT_HEADER.size + len(body), -error, unique) + body)

    while True:
        try:
            request = os.read(fuse, (1 << 17) + 4096)
        except OSError as exc:
            if exc.errno == errno.ENODEV:  # unmounted
                return
            if exc.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: an interrupted request
                continue
            raise
        length, opcode, unique, node, *_ = _IN_HEADER.unpack_from(request)
        arg = request[_IN_HEADER.size : length]
        if opcode == _INIT:
            _major, _minor, readahead, _flags = struct.unpack_from("=IIII", arg)
            body = _INIT_OUT.pack(7, 31, readahead, 0, 16, 12, 4096, 1, 0, 0, 0, 0)
            reply(unique, body.ljust(_INIT_OUT_BYTES, b"\0"))
        elif opcode == _LOOKUP:
            if node == _ROOT and arg.split(b"\0", 1)[0] == FILE_NAME.encode():
                reply(unique, _ENTRY_TIMES.pack(_FILE, 0, 0, 0, 0, 0) + _attr(_FILE))
            else:
                reply(unique, error=errno.ENOENT)
        elif opcode == _GETATTR:
            reply(unique, _ATTR_TIMES.pack(0, 0, 0) + _attr(node))
        elif opcode in (_OPEN, _OPENDIR):
            reply(unique, _OPEN_OUT.pack(0, 0, 0))
        elif opcode in (_RELEASE, _RELEASEDIR):
            reply(unique)
        elif opcode not in (_FORGET, _BATCH_FORGET, _INTERRUPT):  # those get no reply
            reply(unique, error=errno.ENOSYS)  # FLUSH, STATX...: the kernel stops asking


@dataclass(slots=True, kw_only=True)
class FuseMount:
    """A mounted stall file system: ``file`` is its one file."""

    path: Path
    daemon: subprocess.Popen[str]

    @property
    def file(self) -> Path:
        return self.path / FILE_NAME

    def stop(self) -> None:
        """Stop the daemon: from now on a request to it waits until it is killed."""
        self.daemon.send_signal(signal.SIGSTOP)


@contextlib.contextmanager
def fuse_mount(directory: Path) -> Iterator[FuseMount]:
    """The stall file system mounted on a new directory under ``directory`` (needs root and
    ``/dev/fuse``); killed and detached at the end, whatever happened."""
    require(os.geteuid() == 0, "needs root to mount a FUSE file system")
    require(os.path.exists("/dev/fuse"), "needs /dev/fuse")
    mountpoint = directory / "fuse-stall"
    mountpoint.mkdir()
    daemon = subprocess.Popen(
        [sys.executable, "-m", __name__, str(mountpoint)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert daemon.stdout is not None
        line = daemon.stdout.readline().strip()
        require(line == READY, f"the FUSE stand-in did not mount (said {line!r})")
        yield FuseMount(path=mountpoint, daemon=daemon)
    finally:
        daemon.kill()  # SIGKILL ends a stopped process too; its requests fail with ENOTCONN
        daemon.wait()
        if daemon.stdout is not None:
            daemon.stdout.close()
        mnt_detach = 2
        ctypes.CDLL(None, use_errno=True).umount2(str(mountpoint).encode(), mnt_detach)


if __name__ == "__main__":
    serve(sys.argv[1])
