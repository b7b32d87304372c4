"""A real etcd + kube-apiserver for the tests, the benchmarks (soak, scale) and the scripts
(``gpu_e2e --apiserver``, ``dra_demo``).

Owns: a throw-away PKI, starting/stopping the two processes on free loopback ports, admin and
ServiceAccount kubeconfigs, etcd compaction (to force ``410 Gone``), ConfigMaps put as the admin
(``put_config_map``); the control plane around them
(``ControlPlane``, kwok's fake nodes, ``control_plane``); and what every test that starts such
processes shares: ``spawn_logged``, ``script_output`` (the repo's ensure and build scripts),
``helm_binary`` and ``helm_env``. Must not touch anything but the processes it started (stopped
by PID, also on failure) and its own temporary directory; never listens on anything but
127.0.0.1.

The binaries come from ``testbin/bin`` (``scripts/ensure-testbin.sh`` builds them), or from
``$TESTBIN_DIR`` / ``$KUBEBUILDER_ASSETS`` when set.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rigs.prereq import require
from rigs.processes import free_port as free_port  # noqa: PLC0414 (re-exported for tests)
from rigs.processes import terminate as terminate  # noqa: PLC0414 (re-exported for tests)

REPO = Path(__file__).resolve().parents[1]
ENSURE_COMMAND = "scripts/ensure-testbin.sh"


def testbin_dir() -> Path:
    for var in ("TESTBIN_DIR", "KUBEBUILDER_ASSETS"):
        value = os.environ.get(var)
        if value:
            return Path(value)
    return REPO / "testbin" / "bin"


def find_binaries() -> tuple[dict[str, Path], str | None]:
    """``({name: path}, None)``, or ``({}, why)`` when etcd or kube-apiserver is missing."""
    d = testbin_dir()
    found = {n: d / n for n in ("etcd", "kube-apiserver")}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        return {}, f"missing {', '.join(missing)}: run {ENSURE_COMMAND}"
    return found, None


# ---------------------------------------------------------------------------------------------
# PKI


def certificate(
    cn: str,
    key: Any,
    signer: Any,
    issuer: x509.Certificate | None = None,
    *,
    ca: bool = False,
    orgs: Sequence[str] = (),
    eku: Sequence[x509.ObjectIdentifier] = (),
    ips: Sequence[str] = (),
    dns: Sequence[str] = (),
) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
            *[x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs],
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if ca:
        b = b.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    if eku:
        b = b.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    if ips or dns:
        san: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        san += [x509.DNSName(d) for d in dns]
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(signer, hashes.SHA256())


def key_pem(key: Any) -> bytes:
    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem


def make_pki(d: Path) -> dict[str, Path]:
    """CA (and its key), serving cert for 127.0.0.1, admin client cert (``O=system:masters``),
    the API server's client cert towards kubelets, SA keypair."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("gpuguard-test-ca", ca_key, ca_key, ca=True)
    srv, srv_key = signed_by(
        ca,
        ca_key,
        "kube-apiserver",
        eku=[ExtendedKeyUsageOID.SERVER_AUTH],
        # 10.0.0.1: the `kubernetes` Service's ClusterIP, which a real node's pods dial
        # (rigs/kubelet/netns.py).
        ips=["127.0.0.1", "10.0.0.1"],
        dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
    )
    adm, adm_key = signed_by(
        ca,
        ca_key,
        "test-admin",
        orgs=["system:masters"],
        eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    # The API server's client cert towards kubelets (logs, exec, port-forward on a real node,
    # rigs/kubelet/node.py): a superuser, so the kubelet's webhook authorizer allows it.
    kc, kc_key = signed_by(
        ca,
        ca_key,
        "kube-apiserver-kubelet-client",
        orgs=["system:masters"],
        eku=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        # Kept so a real node's kubelet gets its client and serving certs from this CA.
        "ca.key": key_pem(ca_key),
        "kubelet-client.crt": kc.public_bytes(serialization.Encoding.PEM),
        "kubelet-client.key": key_pem(kc_key),
        "apiserver.crt": srv.public_bytes(serialization.Encoding.PEM),
        "apiserver.key": key_pem(srv_key),
        "admin.crt": adm.public_bytes(serialization.Encoding.PEM),
        "admin.key": key_pem(adm_key),
        "sa.key": key_pem(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    return write_private(d, files)


def signed_by(
    issuer: x509.Certificate, issuer_key: Any, cn: str, **kw: Any
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``cn`` on a fresh P-256 key, signed by ``issuer`` (``kw`` as for
    :func:`certificate`), and that key."""
    key = ec.generate_private_key(ec.SECP256R1())
    return certificate(cn, key, issuer_key, issuer, **kw), key


def write_private(d: Path, files: Mapping[str, bytes]) -> dict[str, Path]:
    """Each of ``files`` written under ``d``, readable by its owner only; ``{name: path}``."""
    for n, data in files.items():
        (d / n).write_bytes(data)
        (d / n).chmod(0o600)
    return {n: d / n for n in files}


def write_kubeconfig(
    path: Path,
    server: str,
    ca: bytes,
    *,
    cert: bytes | None = None,
    key: bytes | None = None,
    token: str | None = None,
) -> Path:
    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    if token is not None:
        user: dict[str, str] = {"token": token}
    else:
        assert cert is not None
        assert key is not None
        user = {"client-certificate-data": b64(cert), "client-key-data": b64(key)}
    doc = {  # JSON is valid YAML
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "t",
        "clusters": [
            {"name": "t", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}
        ],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
    }
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------------------------------
# Processes


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, even by a crash that
    skips every teardown (prctl(2) PR_SET_PDEATHSIG), so no etcd or apiserver outlives a run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def spawn_logged(
    cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (with ``env``, else this process's environment) in a session of its own,
    stdout and stderr appended to ``log``, killed when the test process dies
    (:func:`die_with_parent`). The one start of the control plane's and the node's processes."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=None if env is None else dict(env),
        )


def log_tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait_ok(
    url: str,
    *,
    ctx: ssl.SSLContext | None,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # e.g. 500 while post-start hooks run
            last = f"HTTP {e.code}"
            e.close()
        except (OSError, urllib.error.URLError) as e:
            last = e
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}\n{log_tail(log)}")


class AdminRequestError(Exception):
    """An admin request answered with an HTTP error; ``code`` is the status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterTimings:
    etcd_ready_seconds: float
    apiserver_ready_seconds: float


class KubeCluster:
    """etcd + kube-apiserver (RBAC on) on loopback. Use as a context manager or call ``close``.

    ``stop_apiserver``/``start_apiserver`` simulate an outage (same port, same etcd data).
    """

    def __init__(
        self,
        workdir: Path,
        binaries: Mapping[str, Path],
        *,
        service_accounts: bool = False,
        node_egress: bool = False,
    ) -> None:
        """``service_accounts``: the ServiceAccount admission plugin on (pods get their
        projected token, as a real node's pods need); off by default, kwok pods never run.
        ``node_egress``: the API server reaches nodes and pods (kubelet logs, exec) through
        HTTP CONNECT on the Unix socket ``egress_socket`` (its egress selector's ``cluster``),
        which a real node in a network namespace of its own serves (rigs/kubelet/netns.py)."""
        self._service_accounts = service_accounts
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._bin = dict(binaries)
        self.pki = make_pki(workdir)
        self._etcd: subprocess.Popen[bytes] | None = None
        self._api: subprocess.Popen[bytes] | None = None
        self._restarts = 0
        self.etcd_url = ""
        self.apiserver_port = 0
        self.server = ""
        self.timings: ClusterTimings | None = None
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"
        self.egress_socket = self.dir / "node-egress.sock" if node_egress else None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        problems: list[str] = []
        for attempt in range(3):  # free_port() races with other processes: retry
            try:
                t0 = time.monotonic()
                self._start_etcd(attempt)
                t1 = time.monotonic()
                self.apiserver_port = free_port()
                self.server = f"https://127.0.0.1:{self.apiserver_port}"
                write_kubeconfig(
                    self.admin_kubeconfig,
                    self.server,
                    self.pki["ca.crt"].read_bytes(),
                    cert=self.pki["admin.crt"].read_bytes(),
                    key=self.pki["admin.key"].read_bytes(),
                )
                self.start_apiserver()
                self.timings = ClusterTimings(
                    etcd_ready_seconds=t1 - t0, apiserver_ready_seconds=time.monotonic() - t1
                )
                return
            except (RuntimeError, TimeoutError) as e:
                problems.append(str(e))
                self.close()
        raise RuntimeError("could not start etcd + kube-apiserver:\n" + "\n".join(problems))

    def _start_etcd(self, attempt: int) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        log = self.dir / "etcd.log"
        self._etcd = spawn_logged(
            [
                str(self._bin["etcd"]),
                "--name=test",
                f"--data-dir={self.dir}/etcd{attempt}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=test=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            log,
        )
        _wait_ok(f"{self.etcd_url}/health", ctx=None, proc=self._etcd, log=log, timeout=30)

    def start_apiserver(self, *, watch_cache: bool = True, timeout: float = 120.0) -> None:
        """(Re)start kube-apiserver on the same port against the same etcd; wait for /readyz.

        ``watch_cache=False`` serves watches straight from etcd, so a compacted resourceVersion
        reliably answers ``410 Gone`` (with the cache, only the cache window decides).
        """
        assert self._api is None or self._api.poll() is not None, "apiserver already running"
        p = self.pki
        log = self.dir / "apiserver.log"
        self._restarts += 1
        with log.open("ab") as f:
            f.write(f"\n===== start #{self._restarts} watch_cache={watch_cache}\n".encode())
        egress: list[str] = []
        if self.egress_socket is not None:
            config = self.dir / "egress-selector.yaml"
            uds = {"uds": {"udsName": str(self.egress_socket)}}
            connection = {"proxyProtocol": "HTTPConnect", "transport": uds}
            selection = {
                "apiVersion": "apiserver.k8s.io/v1beta1",
                "kind": "EgressSelectorConfiguration",
                "egressSelections": [{"name": "cluster", "connection": connection}],
            }
            config.write_text(json.dumps(selection))  # JSON is YAML
            egress = [f"--egress-selector-config-file={config}"]
        self._api = spawn_logged(
            [
                str(self._bin["kube-apiserver"]),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # 1.37 refuses a loopback advertise address with the endpoint reconciler on
                # ("may not be in the loopback range"); nothing here needs the kubernetes
                # Service endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={self.dir}/certs",
                f"--tls-cert-file={p['apiserver.crt']}",
                f"--tls-private-key-file={p['apiserver.key']}",
                f"--client-ca-file={p['ca.crt']}",
                # Node + NodeRestriction: what a real kubelet (rigs/kubelet/node.py, CN
                # system:node:<name>) is authorized by; no other identity is affected.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={p['kubelet-client.crt']}",
                f"--kubelet-client-key={p['kubelet-client.key']}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--service-account-issuer=https://127.0.0.1:{self.apiserver_port}",
                f"--service-account-key-file={p['sa.pub']}",
                f"--service-account-signing-key-file={p['sa.key']}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                *([] if self._service_accounts else ["--disable-admission-plugins=ServiceAccount"]),
                f"--watch-cache={'true' if watch_cache else 'false'}",
                *egress,
                "--profiling=false",
                "--v=0",
            ],
            log,
        )
        _wait_ok(
            f"{self.server}/readyz",
            ctx=self.ssl_context(),
            proc=self._api,
            log=log,
            timeout=timeout,
        )

    def stop_apiserver(self) -> None:
        """SIGTERM (then SIGKILL) the apiserver we started; etcd keeps running."""
        terminate(self._api)

    @property
    def apiserver_running(self) -> bool:
        return self._api is not None and self._api.poll() is None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in (self._etcd, self._api) if p is not None and p.poll() is None)

    def close(self) -> None:
        terminate(self._api)
        terminate(self._etcd)

    def __enter__(self) -> KubeCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- etcd --------------------------------------------------------------------------------

    def _etcd_post(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.etcd_url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result

    def etcd_revision(self) -> int:
        head = self._etcd_post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})
        return int(head["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd to its current revision: every older resourceVersion is now gone."""
        rev = self.etcd_revision()
        self._etcd_post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    # -- faults (tests/integration/test_faults.py) --------------------------------------------

    def kill_apiserver(self) -> None:
        """SIGKILL the apiserver we started (a crash: no graceful close of its watches); etcd
        keeps running. ``start_apiserver`` brings it back on the same port."""
        if self._api is not None and self._api.poll() is None:
            self._api.kill()
            self._api.wait()

    def stop_etcd(self) -> None:
        """SIGKILL the etcd we started (storage gone, the apiserver keeps running);
        ``start_etcd`` restarts it on the same ports with the same data directory."""
        if self._etcd is not None and self._etcd.poll() is None:
            self._etcd.kill()
            self._etcd.wait()

    def start_etcd(self, timeout: float = 30.0) -> None:
        """Restart the etcd ``stop_etcd`` stopped, with the same command line; wait for /health."""
        assert self._etcd is not None, "etcd was never started"
        assert self._etcd.poll() is not None, "etcd already running"
        log = self.dir / "etcd.log"
        args = self._etcd.args
        assert isinstance(args, list), args  # _start_etcd passes a list
        self._etcd = spawn_logged([str(a) for a in args], log)
        _wait_ok(f"{self.etcd_url}/health", ctx=None, proc=self._etcd, log=log, timeout=timeout)

    # -- clients -------------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki["ca.crt"]))
        ctx.load_cert_chain(str(self.pki["admin.crt"]), str(self.pki["admin.key"]))
        return ctx

    def admin_request(
        self,
        method: str,
        path: str,
        body: Mapping[str, object] | None = None,
        *,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One request as cluster admin; raises ``AdminRequestError`` (``.code``)."""
        req = urllib.request.Request(
            self.server + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=30) as r:
                result: dict[str, Any] = json.loads(r.read() or b"{}")
                return result
        except urllib.error.HTTPError as e:
            with e:
                text = e.read().decode(errors="replace")
            raise AdminRequestError(e.code, f"{method} {path}: HTTP {e.code}: {text}") from None

    def sa_token(self, namespace: str, sa: str, *, seconds: int = 3600) -> str:
        """A real JWT for ``system:serviceaccount:<namespace>:<sa>`` (TokenRequest API)."""
        r = self.admin_request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds},
            },
        )
        token: str = r["status"]["token"]
        return token

    def kubeconfig_for_token(
        self, token: str, name: str = "sa", *, server: str | None = None
    ) -> Path:
        """A kubeconfig that authenticates with ``token``; ``server`` e.g. a ``TcpProxy.url``."""
        return write_kubeconfig(
            self.dir / f"{name}.kubeconfig",
            server or self.server,
            self.pki["ca.crt"].read_bytes(),
            token=token,
        )

    def kubeconfig_for_sa(self, namespace: str, sa: str, *, server: str | None = None) -> Path:
        """A kubeconfig for ``system:serviceaccount:<namespace>:<sa>`` (fresh TokenRequest)."""
        return self.kubeconfig_for_token(
            self.sa_token(namespace, sa),
            name=f"{namespace}-{sa}-{time.monotonic_ns()}",
            server=server,
        )

    # -- objects (as admin) -------------------------------------------------------------------

    def create_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        annotations: Mapping[str, str] | None = None,
        limits: Mapping[str, str] | None = None,
        also: Sequence[str] = (),
    ) -> dict[str, Any]:
        """A pod bound to ``node`` (no scheduler or kubelet exist: it stays Pending), its
        container ``main`` with resource ``limits`` (e.g. another scheduler's extended
        resources), and a container of each name in ``also`` (no limits)."""
        container: dict[str, Any] = {"name": "main", "image": "registry.invalid/cuda:1"}
        if limits:
            container["resources"] = {"limits": dict(limits)}
        others = [{"name": n, "image": "registry.invalid/cuda:1"} for n in also]
        return self.admin_request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "annotations": dict(annotations or {})},
                "spec": {"nodeName": node, "containers": [container, *others]},
            },
        )

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, object]) -> dict[str, Any]:
        return self.admin_request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            patch,
            content_type="application/merge-patch+json",
        )

    def set_container_statuses(
        self, namespace: str, name: str, statuses: Sequence[Mapping[str, object]]
    ) -> dict[str, Any]:
        """What kubelet would report: ``status.containerStatuses`` (status subresource)."""
        full = [
            {
                "image": "registry.invalid/cuda:1",
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                **s,
            }
            for s in statuses
        ]
        return self.admin_request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {"status": {"containerStatuses": full}},
            content_type="application/merge-patch+json",
        )

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete now (grace 0): with spec.nodeName set, a graceful delete waits for a kubelet."""
        self.admin_request(
            "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0"
        )

    def create_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        *,
        annotations: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> dict[str, Any]:
        """A Node object (no kubelet behind it unless the caller starts one, or kwok's)."""
        node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels or {})},
        }
        if annotations:
            node["metadata"]["annotations"] = dict(annotations)
        if taints:
            node["spec"] = {"taints": [dict(t) for t in taints]}
        return self.admin_request("POST", "/api/v1/nodes", node)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> dict[str, Any]:
        return self.admin_request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": dict(labels)}},
            content_type="application/merge-patch+json",
        )


def put_config_map(cluster: KubeCluster, ns: str, name: str, data: Mapping[str, str]) -> None:
    """Create the ConfigMap, or replace its data when it exists (as the admin)."""
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": dict(data)}
    path = f"/api/v1/namespaces/{ns}/configmaps"
    try:
        cluster.admin_request("POST", path, body)
    except AdminRequestError as e:
        if e.code != 409:
            raise
        cluster.admin_request("PUT", f"{path}/{name}", body)


def start_cluster(workdir: Path) -> KubeCluster:
    """Find the binaries (``require`` them), start a cluster; the caller must ``close`` it."""
    binaries, why = find_binaries()
    require(why is None, why or "")
    cluster = KubeCluster(workdir, binaries)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return cluster


def wait_until(
    predicate: Any, *, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"
) -> None:
    """Poll ``predicate()`` until truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(interval)
    if predicate():
        return
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


class TcpProxy:
    """A loopback TCP proxy in front of the API server: one client's view of the network.

    ``partition()`` drops every open connection and refuses new ones (the node lost the API
    server while the rest of the cluster keeps writing); ``heal()`` lets traffic through again.
    ``freeze()`` keeps connections open but forwards nothing (half-open TCP, matrix F4).
    """

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._blocked = False
        self._frozen = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="test-tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                blocked = self._blocked
            if blocked:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                # close() or partition() may have run while we connected upstream: those
                # sockets would never be dropped (a ResourceWarning, and a leaked connection).
                late = self._closed or self._blocked
                if not late:
                    self._conns += [client, upstream]
            if late:
                client.close()
                upstream.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self._frozen.is_set() and not self._closed:
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def partition(self) -> None:
        with self._lock:
            self._blocked = True
        self._frozen.clear()
        self._drop_all()

    def freeze(self) -> None:
        self._frozen.set()

    def heal(self) -> None:
        with self._lock:
            self._blocked = False
        self._frozen.clear()

    def close(self) -> None:
        self._closed = True
        self._frozen.clear()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._drop_all()


# ---------------------------------------------------------------------------------------------
# A whole control plane: controllers, scheduler and kwok's fake nodes around a KubeCluster


CONTROLPLANE_ENSURE_COMMAND = "scripts/ensure-controlplane.sh"
KWOK_STAGES = REPO / "testbin" / "kwok" / "stages"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
"""kwok manages the nodes annotated ``kwok.x-k8s.io/node=fake``, and only those."""


CONTROLPLANE_NAMES = ("kube-controller-manager", "kube-scheduler", "kwok")


def _controlplane_in(d: Path, source: str) -> tuple[dict[str, Path], str | None]:
    found = {n: d / n for n in CONTROLPLANE_NAMES}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        return {}, f"missing {', '.join(missing)} ({source})"
    return found, None


def ensure_controlplane_binaries(timeout: float = 1800.0) -> tuple[dict[str, Path], str | None]:
    """Run ``scripts/ensure-controlplane.sh`` (a hash and three ``--version`` calls once built;
    a cold build takes minutes) and return ``({name: path}, None)``, or ``({}, why)``.

    ``CONTROLPLANE_BIN=<dir>`` names prebuilt binaries instead (no Go needed: the binaries
    carried to another machine, like ``TESTBIN_DIR`` for etcd and kube-apiserver)."""
    prebuilt = os.environ.get("CONTROLPLANE_BIN")
    if prebuilt:
        return _controlplane_in(Path(prebuilt), "CONTROLPLANE_BIN")
    lines, why = script_output(
        CONTROLPLANE_ENSURE_COMMAND, prefix="CONTROLPLANE_BIN=", timeout=timeout
    )
    if lines is None:
        return {}, why
    d = Path(lines[-1].removeprefix("CONTROLPLANE_BIN="))
    return _controlplane_in(d, f"after {CONTROLPLANE_ENSURE_COMMAND}")


def script_output(
    script: str,
    *,
    timeout: float,
    prefix: str = "",
    lines: int = 1,
    runner: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[list[str] | None, str | None]:
    """Run one of the repo's ensure or build scripts (``script``, relative to the repo, through
    ``runner`` if given) and return ``(last lines, None)``: its last ``lines`` stdout lines, the
    last starting with ``prefix``; or ``(None, why)`` when it cannot start, times out, fails or
    prints otherwise."""
    try:
        done = subprocess.run(
            [*runner, str(REPO / script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{script}: {e}"
    last = done.stdout.strip().splitlines()[-lines:]
    if done.returncode != 0 or len(last) != lines or not last[-1].startswith(prefix):
        output = (done.stdout + done.stderr)[-3000:]
        return None, f"{script} exited {done.returncode}:\n{output}"
    return last, None


@dataclass(frozen=True, slots=True)
class PlaneBinaries:
    """etcd and kube-apiserver (``cluster``); kube-controller-manager, kube-scheduler and kwok
    (``plane``)."""

    cluster: dict[str, Path]
    plane: dict[str, Path]


def plane_binaries() -> PlaneBinaries:
    """The binaries a control plane needs, ``require``d (skip locally, fail in CI): etcd and
    kube-apiserver from the testbin, the rest built once by scripts/ensure-controlplane.sh."""
    plane, why = ensure_controlplane_binaries()
    require(why is None, why or "")
    cluster, why = find_binaries()
    require(why is None, why or "")
    return PlaneBinaries(cluster=cluster, plane=plane)


def helm_binary() -> Path:
    """The testbin's helm, ``require``d."""
    helm = testbin_dir() / "helm"
    require(os.access(helm, os.X_OK), f"missing {helm}: run {ENSURE_COMMAND}")
    return helm


def helm_env(home: Path, path: str = "", **extra: str) -> dict[str, str]:
    """An environment for helm that keeps its cache, config and data under ``home`` (never the
    user's), ``PATH`` (default: this process's, else ``/usr/bin:/bin``) and ``extra``."""
    return {
        "PATH": path or os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        **extra,
    }


def _wait_running(proc: subprocess.Popen[bytes], log: Path, seconds: float) -> None:
    """A process without a health endpoint: it must survive its flag parsing and first sync."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{log_tail(log)}")
        time.sleep(0.1)


class ControlPlane:
    """kube-controller-manager, kube-scheduler and kwok around a running ``KubeCluster``.

    The controller-manager runs only the controllers the chart test needs (DaemonSet, garbage
    collector, namespace, node lifecycle, pod GC, ServiceAccount tokens), signing with the API
    server's ServiceAccount key. kwok plays the kubelet for the nodes annotated
    ``kwok.x-k8s.io/node=fake`` (``create_fake_node``): it marks them Ready, renews their
    leases, and runs the pods bound to them (no image is pulled). Every process it starts is
    stopped by PID in ``close`` (also after a failed start); the cluster itself is the caller's.
    """

    CONTROLLERS: tuple[str, ...] = (
        "daemonset",
        "garbagecollector",
        "namespace",
        "nodelifecycle",
        "podgc",
        "serviceaccount-token",
    )
    """The controller-manager's ``--controllers``; a subclass may add some."""

    def __init__(self, cluster: KubeCluster, binaries: Mapping[str, Path]) -> None:
        self.cluster = cluster
        self._bin = dict(binaries)
        self.dir = cluster.dir / "controlplane"
        self.dir.mkdir(exist_ok=True)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        p = self.cluster.pki
        kc = str(self.cluster.admin_kubeconfig)
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}"]
        auth.append(f"--authorization-kubeconfig={kc}")
        self._spawn(
            "kube-controller-manager",
            [
                *auth,
                f"--controllers={','.join(self.CONTROLLERS)}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--service-account-private-key-file={p['sa.key']}",
                f"--root-ca-file={p['ca.crt']}",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [*auth, "--leader-elect=false", "--secure-port=0", "--profiling=false", "--v=1"],
        )
        kwok_port = free_port()
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={kc}",
                *[f"--config={s}" for s in sorted(KWOK_STAGES.glob("*.yaml"))],
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--manage-nodes-with-label-selector=",
                "--manage-single-node=",
                "--cidr=10.0.0.1/16",
                "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{kwok_port}",
            ],
            # kwok also reads ~/.kwok/kwok.yaml: keep it away from the user's.
            env={"HOME": str(self.dir), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        kwok = self._procs["kwok"]
        _wait_ok(
            f"http://127.0.0.1:{kwok_port}/healthz",
            ctx=None,
            proc=kwok,
            log=self.dir / "kwok.log",
            timeout=60,
        )
        for name, proc in self._procs.items():
            _wait_running(proc, self.dir / f"{name}.log", 0.5)

    def _spawn(
        self, name: str, args: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        cmd = [str(self._bin[name]), *args]
        self._procs[name] = spawn_logged(cmd, self.dir / f"{name}.log", env)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs.values() if p.poll() is None)

    def logs(self, n: int = 3000) -> str:
        """The tail of each process' log, for a failing assertion's message."""
        return "\n".join(
            f"== {name}\n{log_tail(self.dir / f'{name}.log', n)}" for name in self._procs
        )

    def close(self) -> None:
        for proc in reversed(list(self._procs.values())):
            terminate(proc)

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_fake_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> dict[str, Any]:
        """A Node kwok manages (annotated ``kwok.x-k8s.io/node=fake``): Ready within seconds."""
        return self.cluster.create_node(
            name,
            {"kubernetes.io/hostname": name, **dict(labels or {})},
            annotations={KWOK_NODE_ANNOTATION: "fake"},
            taints=taints,
        )


class DRAControlPlane(ControlPlane):
    """``ControlPlane`` with the ResourceClaim controller: it makes a pod's claims from its
    ``resourceClaimTemplateName``, deletes them with the pod and deallocates a claim no pod
    reserves. The scheduler's DRA plugin and resource.k8s.io/v1 are on by default in 1.37."""

    CONTROLLERS = (*ControlPlane.CONTROLLERS, "resourceclaim-controller")


@contextlib.contextmanager
def control_plane(
    workdir: Path,
    binaries: PlaneBinaries | None = None,
    *,
    plane_class: type[ControlPlane] = ControlPlane,
    node_egress: bool = False,
) -> Iterator[ControlPlane]:
    """Its own etcd + kube-apiserver (a ``KubeCluster`` in ``workdir``: ``plane.cluster``) and a
    ``plane_class`` around it, started; every process stopped by PID on exit, also after a failed
    start. ``binaries``: :func:`plane_binaries` when not given; ``node_egress`` as for
    ``KubeCluster`` (a real node's cluster)."""
    bins = binaries or plane_binaries()
    cluster = KubeCluster(workdir, bins.cluster, node_egress=node_egress)
    plane = plane_class(cluster, bins.plane)
    try:
        cluster.start()
        plane.start()
        yield plane
    finally:
        plane.close()
        cluster.close()
