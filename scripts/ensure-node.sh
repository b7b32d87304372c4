#!/usr/bin/env bash
# Builds (once) the parts of a real Kubernetes node for the real-node test, into a
# cache outside the repo keyed by go version + the pinned versions + the wrapper modules under
# testbin/node/ (go.mod + go.sum committed, checksums verified) + this script's build commands:
#
#   kubelet                  k8s.io/kubernetes/cmd/kubelet v1.37.2, CGO_ENABLED=0, the API server's
#                            staging replaces (testbin/node/kubelet), its version ldflags
#   containerd, ctr,         github.com/containerd/containerd/v2 v2.4.2, CGO_ENABLED=0, tags
#   containerd-shim-runc-v2  no_btrfs no_zfs no_devmapper no_aufs (no graph-driver C libraries)
#   runc                     github.com/opencontainers/runc v1.3.7, cgo, tag seccomp, linked
#                            statically (runc's own `make static`) against Debian's libseccomp-dev,
#                            so the binary needs no libseccomp on the machine that runs it
#   cni/{bridge,host-local,loopback}
#                            github.com/containernetworking/plugins v1.9.1
#   gpu-device-plugin        testbin/node/deviceplugin (main.go, our own): a kubelet device plugin
#                            (k8s.io/kubelet deviceplugin v1beta1 v0.37.2, grpc) advertising
#                            stand-in GPUs with time-slicing replicas, CGO_ENABLED=0
#
# Debian's libseccomp-dev is fetched the way the other scripts fetch Debian tools: `apt-get
# download` (verified by apt against the signed archive index) and `dpkg-deb -x` into the cache;
# nothing is installed system-wide. Needs go1.26.x, gcc, apt-get, dpkg-deb, pkg-config, flock.
#
# Each binary is built into a scratch name and moved into place last, under a lock (parallel runs
# wait for each other, an interrupted run resumes where it stopped). Idempotent: a warm cache costs
# a hash and the --version calls. The last line of stdout is `NODE_BIN=<dir>` (binaries in <dir>,
# CNI plugins in <dir>/cni); everything else goes to stderr.
#
# Measured 2026-12-04 on the 2-vCPU CI machine kind (shared with other jobs), warm Go module cache:
#   empty GOCACHE (what a fresh CI machine pays):  kubelet ~415 s (peak RSS
#     2.0 GB), containerd+ctr+shim ~121 s, runc ~21 s, CNI ~5 s
#   first run here, GOCACHE already warm from earlier kube builds (19:10 UTC, load ~3): 94 s wall
#     (kubelet 5 s after a 41 s standalone build, containerd 49 s, ctr 4 s, shim 1 s, runc 30 s
#     incl. the libseccomp-dev download, CNI 4 s); 183 MB cached
#   warm cache (nothing to build): ~1 s
#
#   NODE_CACHE=/dir            cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-node)
#   NODE_ONLY="runc"           build a subset (default: all; names as in ALL below)
#   --init                     one-off, to bump versions (commit the result): recreate the wrapper
#                              modules under testbin/node through the Go module proxy
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB="$ROOT/testbin/node"
K8S=1.37.2
CONTAINERD=v2.4.2
RUNC=v1.3.7
CNI=v1.9.1
LIBSECCOMP=2.5.4-1+deb12u1 # Debian 12 (bookworm)
ALL=(kubelet containerd runc cni deviceplugin)
read -r -a WANT <<<"${NODE_ONLY:-${ALL[*]}}"
export PATH="$PATH:/usr/local/go/bin"
export GOWORK=off GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
START=$SECONDS

say() { printf '[ensure-node %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "$*"; exit 1; }

command -v go >/dev/null || die "go not found (need go1.26.x on PATH or /usr/local/go/bin)"

if [[ ${1:-} == --init ]]; then
  # mod DIR TOOL...: a wrapper module whose tools are TOOL... (path@version).
  mod() {
    local dir=$1
    shift
    (cd "$TB" && rm -rf "$dir" && mkdir "$dir" && cd "$dir" \
      && go mod init "testbin/node/$dir" && go mod edit -go=1.26.0 \
      && if [[ $dir == kubelet ]]; then
        # The kubelet comes from the very k8s.io/kubernetes the API server is built from: same
        # version, same staging replaces (testbin/kube-apiserver/go.mod).
        sed -n 's/^replace \(.*\) => \(.*\) \(.*\)$/\1=\2@\3/p' "$ROOT/testbin/kube-apiserver/go.mod" \
          | while read -r r; do go mod edit -replace="$r"; done
      fi \
      && go get -tool "$@" && go mod tidy)
  }
  mkdir -p "$TB"
  mod kubelet "k8s.io/kubernetes/cmd/kubelet@v$K8S"
  mod containerd "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD" \
    "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD"
  mod runc "github.com/opencontainers/runc@$RUNC"
  mod cni "github.com/containernetworking/plugins/plugins/main/bridge@$CNI" \
    "github.com/containernetworking/plugins/plugins/main/loopback@$CNI" \
    "github.com/containernetworking/plugins/plugins/ipam/host-local@$CNI"
  say "init done: commit testbin/node"
  exit 0
fi

KEY=$({
  go version
  echo "$K8S $CONTAINERD $RUNC $CNI $LIBSECCOMP"
  cat "$TB"/*/go.mod "$TB"/*/go.sum "$TB"/deviceplugin/main.go
  grep -v '^[[:space:]]*#' "$0" # the build commands below (comments aside)
} | sha256sum | cut -c1-16)
BASE="${NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-node}"
DEST="$BASE/$KEY"
mkdir -p "$DEST/cni"
exec 9>"$BASE/.lock"
flock 9 # one builder at a time; a waiter then finds the binaries built
TMP=$(mktemp -d "$BASE/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# build NAME MODULE PACKAGE CGO TAGS LDFLAGS: one binary of a wrapper module into $DEST/NAME.
build() {
  local name=$1 dir=$2 pkg=$3 cgo=$4 tags=$5 ldf=$6 t0=$SECONDS
  if [[ -x $DEST/$name ]]; then
    say "$name: cached"
    return
  fi
  say "$name: building from testbin/node/$dir…"
  (cd "$TB/$dir" && CGO_ENABLED=$cgo nice -n 10 go build -trimpath -tags "$tags" -ldflags "$ldf" \
    -o "$TMP/${name##*/}" "$pkg")
  mv -f "$TMP/${name##*/}" "$DEST/$name"
  say "$name: built in $((SECONDS - t0))s"
}

# Debian's libseccomp-dev (headers, libseccomp.a, libseccomp.pc) unpacked into the cache; pkg-config
# finds it through PKG_CONFIG_PATH and rewrites its /usr paths with PKG_CONFIG_SYSROOT_DIR.
libseccomp() {
  local dir="$BASE/libseccomp-$LIBSECCOMP" scratch
  if [[ ! -f $dir/usr/lib/x86_64-linux-gnu/libseccomp.a ]]; then
    for tool in apt-get dpkg-deb pkg-config "${CC:-gcc}"; do
      command -v "$tool" >/dev/null || die "$tool not found (runc needs Debian and a C compiler)"
    done
    scratch=$(mktemp -d "$BASE/.deb.XXXXXX")
    (cd "$scratch" && apt-get download "libseccomp-dev=$LIBSECCOMP" >&2)
    dpkg-deb -x "$scratch"/libseccomp-dev_*.deb "$scratch/root"
    rm -rf "$dir"
    mv "$scratch/root" "$dir"
    rm -rf "$scratch"
    say "libseccomp-dev $LIBSECCOMP unpacked into $dir"
  fi
  export PKG_CONFIG_PATH="$dir/usr/lib/x86_64-linux-gnu/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$dir"
}

MINOR=$(cut -d. -f2 <<<"$K8S")
KUBE_LDF="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  KUBE_LDF+=" -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MINOR"
  KUBE_LDF+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
CTRD_TAGS="no_btrfs no_zfs no_devmapper no_aufs"
CTRD_LDF="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD"
CTRD_LDF+=" -X github.com/containerd/containerd/v2/version.Revision=$CONTAINERD"
CNI_LDF="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI"
VERSIONS=()
for part in "${WANT[@]}"; do
  case $part in
    kubelet)
      build kubelet kubelet k8s.io/kubernetes/cmd/kubelet 0 "" "$KUBE_LDF"
      VERSIONS+=("$DEST/kubelet --version") ;;
    containerd)
      for b in containerd ctr containerd-shim-runc-v2; do
        build "$b" containerd "github.com/containerd/containerd/v2/cmd/$b" 0 "$CTRD_TAGS" "$CTRD_LDF"
      done
      VERSIONS+=("$DEST/containerd --version" "$DEST/ctr --version" "$DEST/containerd-shim-runc-v2 -v") ;;
    runc)
      # runc's `make static`: static PIE, netgo + osusergo (no NSS lookups in a static binary).
      [[ -x $DEST/runc ]] || libseccomp
      GOFLAGS="$GOFLAGS -buildmode=pie" build runc runc github.com/opencontainers/runc 1 \
        "seccomp urfave_cli_no_docs netgo osusergo" "-s -w -linkmode external -extldflags -static-pie"
      VERSIONS+=("$DEST/runc --version") ;;
    cni)
      for b in main/bridge main/loopback ipam/host-local; do
        build "cni/${b#*/}" cni "github.com/containernetworking/plugins/plugins/$b" 0 "" "$CNI_LDF"
      done
      VERSIONS+=("$DEST/cni/bridge --version") ;;
    deviceplugin)
      build gpu-device-plugin deviceplugin . 0 "" "-s -w"
      VERSIONS+=("$DEST/gpu-device-plugin --version") ;;
    *) die "unknown part $part (one of: ${ALL[*]})" ;;
  esac
done
for v in "${VERSIONS[@]}"; do
  say "$(${v} 2>&1 | head -1)"
done
say "ready (total ${SECONDS}s)"
echo "NODE_BIN=$DEST"
