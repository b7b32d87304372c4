#!/usr/bin/env bash
# `make image`: builds the gpuguard image from the repo's own Dockerfile with BuildKit, without
# Docker, as an OCI image layout archive: build/gpuguard-image.oci.tar (IMAGE_NAME, default
# docker.io/library/gpuguard:test). It carries io.containerd.image.name (ctr -n k8s.io images
# import names it with it; a pod spec then says `gpuguard:test`, imagePullPolicy Never or
# IfNotPresent), org.opencontainers.image.ref.name (the tag) and a Docker manifest.json (`docker
# load`); scripts/push-image.sh (`make push-image`) pushes it to a registry with crane.
#
# The base (the Dockerfile's `ARG PYTHON_IMAGE`) is the builder's choice, one of:
#   BASE_IMAGE=REF      an image in a registry BuildKit pulls from; default the Dockerfile's own
#                       (python:3.11.11-slim-bookworm, Docker Hub)
#   BASE_ARCHIVE=PATH   an OCI image archive (or layout directory) holding one image, given to
#                       the Dockerfile as a named context (oci-layout://…@digest): FROM pulls
#                       nothing. `make python-base` builds one from Debian's packages
#                       (scripts/ensure-python-base.sh: Debian 12's python3, the tests' base):
#                       BASE_ARCHIVE=build/python-base.oci.tar
# Before anything is built, the chosen base is checked: an archive must hold one image; the
# registry of an image must answer on https://<registry>/v2/ within 10 s. Else it stops at once,
# naming both options (no long BuildKit pull error after minutes of building BuildKit).
#
# The pieces, each cached outside the repo by its own script:
#   scripts/ensure-buildkit.sh      buildkitd + buildctl v0.34.2
#   scripts/ensure-node.sh          runc v1.3.7 (NODE_ONLY=runc), BuildKit's OCI worker runtime
# then a rootful buildkitd runs for this build only: its root, socket, runc state and config in a
# scratch directory, OCI worker with host networking (RUN pip install reaches PyPI), containerd
# worker and CDI off, its containers under a cgroup parent of their own (gpuguard-image-<pid>). On
# exit, also on failure: buildkitd stopped by its PID (SIGTERM, SIGKILL after 30 s), whatever it
# left mounted under the scratch directory unmounted, the cgroup directories removed, the scratch
# directory removed. Nothing is written to /var/lib, /run or /etc.
#
# Then the entry point is checked the way a node runs it: the exported archive's layers unpacked
# and `gpuguard --help` (ENTRYPOINT + CMD, the image's Env) run by runc as uid 65534 (the agent's
# user), so the console script's shebang has to resolve in the final stage. In the same rootfs the
# image's python3 then imports the fast path's quiet gate (gpuguard.adapters.nvml._gate, the C
# extension setup.py builds; the Dockerfile's build stage fails without it too) and gate.py has to
# find it, then the allocation guard's loader (linked to the final stage's libbpf.so.1) and its
# BPF object at allocguard.GUARD_OBJECT, and no C compiler (cc, gcc*, *-gcc*) may be on the final
# stage's bin directories: the compiler belongs to the build stage only.
#
# Machine needs: root, Go 1.26 and gcc (the builds above), python3, overlayfs (else
# IMAGE_SNAPSHOTTER=native), network to PyPI and the base's registry (BASE_IMAGE) or to
# deb.debian.org (the build stage's apt-get). Without CAP_SYS_RESOURCE runc is fine: BuildKit's OCI
# worker leaves oom_score_adj unset.
#
# Measured 2026-12-05 on the 2-vCPU CI machine kind (shared with other jobs' Go builds, load
# 14-23): with BuildKit and runc cached and the base rebuilt 251 s; warm 123 s (the Dockerfile
# 60 s, mostly pip install; the entry point check 6 s; ~50 s removing BuildKit's scratch root),
# 37 s once the other builds had finished (the Dockerfile 32 s, cleanup 2 s).
# 2026-12-06 with the quiet gate (load ~1.5-2.3): warm 45 s (the Dockerfile 37 s, of which 8 s
# apt-get of gcc, libc6-dev and libpython3.11-dev and 3 s pip install . with the gate's compile;
# the entry point check 5 s, the gate check under 1 s); with the base rebuilt (apt added) 65 s.
# Cold pieces, in parallel: BuildKit 412 s, runc 142 s, the base 138-158 s.
# 2026-12-08 with the allocation guard (BASE_ARCHIVE, load ~3-4): 60 s (the Dockerfile 50 s, of
# which ensure-bpf.sh's download of clang, llvm, libbpf and bpftool and the final stage's
# libbpf1 are the new part); the archive grew by 0.7 MB.
#
# Progress goes to stderr; the last line of stdout is the archive's path and the name inside.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${IMAGE_OUT:-$ROOT/build}
NAME=${IMAGE_NAME:-docker.io/library/gpuguard:test}
SNAPSHOTTER=${IMAGE_SNAPSHOTTER:-overlayfs}
START=$SECONDS

DEFAULT_BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$ROOT/Dockerfile")

say() { printf '[build-image %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "$*"; exit 1; }

usage() {
  cat <<EOF
usage: [VAR=value ...] scripts/build-image.sh   (or: make image [VAR=value ...]), as root
Builds build/gpuguard-image.oci.tar from the Dockerfile with BuildKit, without Docker.
The base, one of:
  BASE_IMAGE=REF       an image in a registry BuildKit pulls from
                       (default: the Dockerfile's $DEFAULT_BASE)
  BASE_ARCHIVE=PATH    an OCI image archive (or layout directory) holding one image; 'make
                       python-base' builds Debian 12's python3 into build/python-base.oci.tar
Also:
  IMAGE_NAME=NAME:TAG  the name inside the archive (default docker.io/library/gpuguard:test)
  IMAGE_OUT=DIR        output directory (default build/)
  IMAGE_SNAPSHOTTER=native  BuildKit's snapshotter where overlayfs is not available
  NODE_BIN=DIR         a directory with runc already built (skips scripts/ensure-node.sh)
Push the archive with scripts/push-image.sh (make push-image IMAGE_REPOSITORY=... IMAGE_TAG=...).
EOF
}

# refuse WHY: the chosen base is not usable: say why and what the two options are, exit 2.
refuse() {
  say "$1"
  cat >&2 <<EOF
Choose the image's base, one of:
  BASE_IMAGE=REF      a base in a registry this machine reaches (BuildKit pulls it), e.g. a
                      mirror of $DEFAULT_BASE: make image BASE_IMAGE=REF
  BASE_ARCHIVE=PATH   an OCI image archive holding one image, e.g. Debian 12's python3:
                      make python-base && make image BASE_ARCHIVE=build/python-base.oci.tar
EOF
  exit 2
}

case ${1:-} in
  -h | --help)
    usage
    exit 0
    ;;
  "") ;;
  *)
    usage >&2
    exit 2
    ;;
esac

# base_check image REF | archive PATH: a registry image's registry answers on /v2/ (any HTTP
# status: 401 is the usual answer); an archive holds one image. On failure prints why; for an
# archive, prints the image's digest and name, tab-separated.
base_check() {
  python3 - "$@" <<'EOF'
import json, sys, tarfile, urllib.error, urllib.request
from pathlib import Path

kind, value = sys.argv[1], sys.argv[2]
if kind == "image":
    first, slash, _ = value.partition("/")
    # The reference's first component is a registry only with a dot, a port or "localhost".
    registry = first if slash and ("." in first or ":" in first or first == "localhost") else ""
    host = registry or "registry-1.docker.io"
    try:
        urllib.request.urlopen(f"https://{host}/v2/", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except Exception as e:  # DNS, refused, timeout, TLS: BuildKit could not pull either
        reason = getattr(e, "reason", None) or e
        sys.exit(f"its registry {host} is not reachable (https://{host}/v2/: {reason})")
    sys.exit(0)
path = Path(value)
try:
    if path.is_dir():
        index = json.loads((path / "index.json").read_text())
    else:
        with tarfile.open(path) as tar:
            member = tar.extractfile("index.json")
            if member is None:
                raise KeyError("index.json")
            index = json.load(member)
    manifests = index["manifests"]
except (OSError, KeyError, ValueError, tarfile.TarError) as e:
    sys.exit(f"not an OCI image archive or layout ({type(e).__name__}: {e})")
if len(manifests) != 1:
    sys.exit(f"it holds {len(manifests)} images, not one")
name = manifests[0].get("annotations", {}).get("io.containerd.image.name", "")
print(manifests[0]["digest"], name, sep="\t")
EOF
}

# The base, checked before anything is built (BuildKit's own build takes minutes when cold).
if [[ -n ${BASE_IMAGE:-} && -n ${BASE_ARCHIVE:-} ]]; then
  refuse "BASE_IMAGE and BASE_ARCHIVE are both set: one base only"
elif [[ -n ${BASE_ARCHIVE:-} ]]; then
  BASE_ARCHIVE=$(realpath -m "$BASE_ARCHIVE")
  found=$(base_check archive "$BASE_ARCHIVE" 2>&1) || refuse "BASE_ARCHIVE=$BASE_ARCHIVE: $found"
  BASE_DIGEST=${found%%$'\t'*}
  say "base: the archive $BASE_ARCHIVE (${found#*$'\t'} $BASE_DIGEST)"
else
  BASE_IMAGE=${BASE_IMAGE:-$DEFAULT_BASE}
  what="the Dockerfile's default base $BASE_IMAGE"
  [[ $BASE_IMAGE == "$DEFAULT_BASE" ]] || what="BASE_IMAGE=$BASE_IMAGE"
  why=$(base_check image "$BASE_IMAGE" 2>&1) || refuse "$what: $why"
  say "base: $BASE_IMAGE, pulled by BuildKit"
fi

[[ $(id -u) == 0 ]] || die "needs root (a rootful buildkitd)"
[[ $NAME == *:* ]] || die "IMAGE_NAME $NAME has no tag"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpuguard-image.XXXXXX")
CG="gpuguard-image-$$"
BKPID=""
BCPID=""
JOBS=()

cleanup() {
  local rc=$? mnt dir i job
  set +e # every step below runs, whatever an earlier one did
  for job in "${JOBS[@]}"; do # ensure scripts still running (interrupted): their process groups
    kill -TERM -- "-$job" 2>/dev/null
  done
  if [[ -n $BCPID ]] && kill -0 "$BCPID" 2>/dev/null; then # an interrupted buildctl
    kill -TERM "$BCPID"
    wait "$BCPID" 2>/dev/null
  fi
  if [[ -n $BKPID ]] && kill -0 "$BKPID" 2>/dev/null; then
    local t0=$SECONDS
    kill -TERM "$BKPID"
    for ((i = 0; i < 300; i++)); do
      kill -0 "$BKPID" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$BKPID" 2>/dev/null; then
      say "buildkitd did not stop in 30 s: SIGKILL"
      kill -KILL "$BKPID"
    fi
    wait "$BKPID" 2>/dev/null
    say "buildkitd stopped in $((SECONDS - t0))s"
  fi
  # Mounts buildkitd left under the scratch directory, deepest first (mountinfo field 5).
  while read -r mnt; do
    umount "$mnt" 2>/dev/null || umount -l "$mnt" || say "could not unmount $mnt"
  done < <(awk -v w="$WORK" 'index($5, w "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
  for dir in /sys/fs/cgroup/*/"$CG"; do
    if [[ -d $dir ]] && ! find "$dir" -depth -type d -exec rmdir {} +; then
      say "cgroup $dir left behind"
    fi
  done
  rm -rf --one-file-system "$WORK" || say "could not remove $WORK"
  [[ -z $BKPID ]] || say "cleaned up: buildkitd's root, the scratch directory, its cgroups"
  [[ $rc == 0 ]] || say "failed (exit $rc)"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ensure NAME SCRIPT [ENV...]: run one ensure script (env assignments first), its last stdout line
# KEY=DIR into $WORK/NAME.
ensure() {
  local name=$1 script=$2
  shift 2
  env "$@" bash "$ROOT/scripts/$script" >"$WORK/$name.out"
}

say "BuildKit and runc (cached after the first run)…"
# The two are independent Go builds. Each runs in a process group of its own (set -m), so an
# interrupted build can stop it whole.
set -m
ensure buildkit ensure-buildkit.sh &
JOBS+=($!)
if [[ -n ${NODE_BIN:-} && -x ${NODE_BIN:-}/runc ]]; then
  echo "NODE_BIN=$NODE_BIN" >"$WORK/node.out"
else
  ensure node ensure-node.sh NODE_ONLY=runc &
  JOBS+=($!)
fi
set +m
failed=0
for job in "${JOBS[@]}"; do wait "$job" || failed=1; done
JOBS=()
((failed == 0)) || die "a prerequisite failed (see above)"
BUILDKIT_BIN=$(tail -1 "$WORK/buildkit.out" | sed -n 's/^BUILDKIT_BIN=//p')
NODE_BIN=$(tail -1 "$WORK/node.out" | sed -n 's/^NODE_BIN=//p')
[[ -x $BUILDKIT_BIN/buildkitd && -x $NODE_BIN/runc ]] \
  || die "an ensure script did not print its directory"

# runc with its state under the scratch directory (BuildKit's executor would use /run/runc).
mkdir -p "$WORK/runc-state"
cat >"$WORK/runc" <<EOF
#!/bin/sh
exec "$NODE_BIN/runc" --root "$WORK/runc-state" "\$@"
EOF
chmod +x "$WORK/runc"
cat >"$WORK/buildkitd.toml" <<EOF
[cdi]
  disabled = true
[worker.oci]
  defaultCgroupParent = "$CG"
EOF

say "starting buildkitd (root $WORK/root, snapshotter $SNAPSHOTTER)…"
SOCK="unix://$WORK/buildkitd.sock"
"$BUILDKIT_BIN/buildkitd" --config "$WORK/buildkitd.toml" --root "$WORK/root" --addr "$SOCK" \
  --oci-worker=true --containerd-worker=false --oci-worker-binary "$WORK/runc" \
  --oci-worker-net=host --oci-worker-snapshotter="$SNAPSHOTTER" \
  --otel-socket-path "$WORK/otel-grpc.sock" >"$WORK/buildkitd.log" 2>&1 &
BKPID=$!
for ((i = 0; ; i++)); do
  "$BUILDKIT_BIN/buildctl" --addr "$SOCK" debug workers >/dev/null 2>&1 && break
  if ! kill -0 "$BKPID" 2>/dev/null || ((i >= 300)); then
    tail -20 "$WORK/buildkitd.log" >&2
    die "buildkitd did not come up"
  fi
  sleep 0.1
done

mkdir -p "$OUT"
if [[ -z ${BASE_ARCHIVE:-} ]]; then
  BUILD=(--opt build-arg:PYTHON_IMAGE="$BASE_IMAGE")
else
  # The archive's image as a named context the Dockerfile frontend finds by the FROM name:
  # buildctl's --oci-layout store writes an ingest/ directory into the layout, so a copy (of a
  # layout directory: linked) keeps the given one untouched.
  mkdir "$WORK/base-layout"
  if [[ -d $BASE_ARCHIVE ]]; then
    cp -rl "$BASE_ARCHIVE/." "$WORK/base-layout" 2>/dev/null \
      || cp -r "$BASE_ARCHIVE/." "$WORK/base-layout"
  else
    tar -xf "$BASE_ARCHIVE" -C "$WORK/base-layout"
  fi
  BASE_IMAGE=gpuguard-base:archive
  BUILD=(--oci-layout base="$WORK/base-layout"
    --opt build-arg:PYTHON_IMAGE="$BASE_IMAGE"
    --opt context:"$BASE_IMAGE"=oci-layout://base@"$BASE_DIGEST")
fi
# type=docker with OCI media types: the same OCI image layout (index.json, blobs, oci-layout) as
# type=oci, plus the Docker manifest.json that `docker load` before Docker 25 needs.
say "building the Dockerfile on $BASE_IMAGE…"
t0=$SECONDS
# In the background with `wait`, so a SIGTERM to this script stops the build at once (bash runs
# traps only between foreground commands).
"$BUILDKIT_BIN/buildctl" --addr "$SOCK" build --progress=plain \
  --frontend dockerfile.v0 --local context="$ROOT" --local dockerfile="$ROOT" "${BUILD[@]}" \
  --output "type=docker,oci-mediatypes=true,dest=$WORK/gpuguard-image.oci.tar,name=$NAME" &
BCPID=$!
if ! wait "$BCPID"; then
  tail -20 "$WORK/buildkitd.log" >&2
  die "buildctl build failed"
fi
say "built in $((SECONDS - t0))s"

say "checking the entry point: gpuguard --help as uid 65534 under runc…"
CHECK="$WORK/check"
mkdir -p "$CHECK/oci" "$CHECK/rootfs"
tar -xf "$WORK/gpuguard-image.oci.tar" -C "$CHECK/oci"
"$NODE_BIN/runc" spec --bundle "$CHECK"
# The image's manifest (through a nested index if BuildKit wrote one), its layers in order and
# its config into runc's config.json: args = Entrypoint + Cmd, env, cwd; uid 65534; read-only root.
# gate.json: the same with the quiet gate's import as the process.
python3 - "$CHECK" "$CG" >"$CHECK/layers" <<'PY'
import json, sys
from pathlib import Path

bundle, cgroup = Path(sys.argv[1]), sys.argv[2]
oci = bundle / "oci"


def blob(digest):
    return json.loads((oci / "blobs" / "sha256" / digest.split(":", 1)[1]).read_text())


node = json.loads((oci / "index.json").read_text())
while "manifests" in node:
    node = blob(next(m for m in node["manifests"]
                     if m.get("platform", {}).get("architecture", "amd64") == "amd64")["digest"])
image = blob(node["config"]["digest"])["config"]
spec = json.loads((bundle / "config.json").read_text())
spec["process"].update(
    terminal=False, user={"uid": 65534, "gid": 65534},
    args=image.get("Entrypoint", []) + image.get("Cmd", []), env=image.get("Env", []),
    cwd=image.get("WorkingDir") or "/",
)
spec["linux"]["cgroupsPath"] = f"/{cgroup}/check"
(bundle / "config.json").write_text(json.dumps(spec))
gate_check = (
    "from gpuguard.adapters.nvml import _gate, gate\n"
    "assert gate.native_gate_built(), 'gate.py did not load the extension'\n"
    "print('quiet gate:', _gate.__file__)\n"
    "from gpuguard.adapters.allocguard import GUARD_OBJECT, _loader\n"
    "assert GUARD_OBJECT.is_file(), f'no allocation guard object at {GUARD_OBJECT}'\n"
    "print('allocation guard:', _loader.__file__, GUARD_OBJECT)\n"
)
spec["process"]["args"] = ["/usr/local/bin/python3", "-B", "-c", gate_check]
spec["linux"]["cgroupsPath"] = f"/{cgroup}/gate"
(bundle / "gate.json").write_text(json.dumps(spec))
for layer in node["layers"]:
    print(oci / "blobs" / "sha256" / layer["digest"].split(":", 1)[1])
PY
while read -r layer; do
  tar -xzf "$layer" -C "$CHECK/rootfs" # no whiteouts: each layer only adds files
done <"$CHECK/layers"
if ! "$NODE_BIN/runc" --root "$WORK/runc-state" run --bundle "$CHECK" "$CG-check" \
  >"$CHECK/out" 2>&1 </dev/null || ! grep -q '^usage: gpuguard' "$CHECK/out"; then
  cat "$CHECK/out" >&2
  die "the image's entry point did not run"
fi
say "entry point ok: $(head -1 "$CHECK/out")"

say "checking the quiet gate: imported by the image's python3 as uid 65534, no C compiler…"
mv -f "$CHECK/gate.json" "$CHECK/config.json"
if ! "$NODE_BIN/runc" --root "$WORK/runc-state" run --bundle "$CHECK" "$CG-gate" \
  >"$CHECK/out" 2>&1 </dev/null || ! grep -q '^quiet gate: /' "$CHECK/out"; then
  cat "$CHECK/out" >&2
  die "the image has no working quiet gate (gpuguard.adapters.nvml._gate) or allocation guard"
fi
say "$(grep '^quiet gate: /' "$CHECK/out")"
# The loader imported above resolved libbpf.so.1 in the final stage (the libbpf1 package), not
# in the build stage's tools; the BPF object is where the enforcer loads it from.
grep -q '^allocation guard: /' "$CHECK/out" || {
  cat "$CHECK/out" >&2
  die "the image has no loadable allocation guard (its loader or its BPF object)"
}
say "$(grep '^allocation guard: /' "$CHECK/out")"
COMPILERS=$(find "$CHECK/rootfs/usr/bin" "$CHECK/rootfs/usr/local/bin" -maxdepth 1 \
  \( -name cc -o -name 'gcc*' -o -name '*-gcc*' \) -printf '%f ' 2>/dev/null || true)
[[ -z $COMPILERS ]] || die "a C compiler in the final image: $COMPILERS"
say "no C compiler in the final image"

chmod 644 "$WORK/gpuguard-image.oci.tar"
mv -f "$WORK/gpuguard-image.oci.tar" "$OUT/gpuguard-image.oci.tar"
say "done in ${SECONDS}s (stopping buildkitd, cleaning up)"
echo "$OUT/gpuguard-image.oci.tar $NAME"
