#!/usr/bin/env bash
# Builds (once) the real kube-apiserver, etcd and helm the integration tests run, from the Go
# wrapper modules in testbin/, into a cache outside the repo keyed by go version + module files,
# and points testbin/bin at it. Idempotent: a warm cache costs a hash and three --version calls.
#
#   KUBEBUILDER_ASSETS=/dir   use the binaries found there (envtest's etcd, kube-apiserver)
#                             instead of building them; build only the missing ones
#   TESTBIN_CACHE=/dir        cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-testbin)
#   TESTBIN_ONLY="etcd kube-apiserver"   build a subset (default: all three)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB="$ROOT/testbin"
K8S=1.37.2
HELM=v4.3.2
ALL=(kube-apiserver etcd helm)
read -r -a WANT <<<"${TESTBIN_ONLY:-${ALL[*]}}"
export PATH="$PATH:/usr/local/go/bin"
export GOWORK=off CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
START=$SECONDS

say() { printf '[ensure-testbin %4ds] %s\n' "$((SECONDS - START))" "$*"; }

BASE="${TESTBIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-testbin}"
have_go() { command -v go >/dev/null; }
key() {
  { go version; echo "$K8S $HELM"
    cat "$TB"/kube-apiserver/go.mod "$TB"/kube-apiserver/go.sum \
        "$TB"/etcd/go.mod "$TB"/etcd/go.sum "$TB"/etcd/main.go \
        "$TB"/helm/go.mod "$TB"/helm/go.sum; } | sha256sum | cut -c1-16
}
if [[ -n ${KUBEBUILDER_ASSETS:-} ]]; then
  # Use what the assets dir has (envtest ships etcd + kube-apiserver, usually no helm);
  # build only what it lacks.
  DEST="$BASE/assets-$(echo "$KUBEBUILDER_ASSETS" | sha256sum | cut -c1-12)"
  mkdir -p "$DEST"
  for b in "${WANT[@]}"; do
    if [[ -x $KUBEBUILDER_ASSETS/$b ]]; then
      ln -sfn "$KUBEBUILDER_ASSETS/$b" "$DEST/$b"
      say "$b: from KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
    fi
  done
else
  have_go || { say "go not found (need go1.26.x on PATH or /usr/local/go/bin)"; exit 1; }
  DEST="$BASE/$(key)"
  mkdir -p "$DEST"
fi
exec 9>"$DEST/.lock"
flock 9 # one builder at a time (make gobins and a test may start together): a waiter finds it built
avail=$(df -Pk "$BASE" | awk 'NR==2{print int($4/1024/1024)}')
MINOR=$(cut -d. -f2 <<<"$K8S")
LDF="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDF+=" -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MINOR"
  LDF+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build() {  # name, module dir, package, ldflags, hint
  local name=$1 dir=$2 pkg=$3 ldf=$4 hint=$5 t0=$SECONDS
  if [[ -x $DEST/$name ]]; then say "$name: cached ($DEST)"; return; fi
  have_go || { say "go not found: cannot build $name"; exit 1; }
  if ((avail < 8)); then say "warning: only ${avail} GiB free under $BASE (a cold build needs ~6 GiB)"; fi
  say "building $name ($hint)…"
  (cd "$TB/$dir" && nice -n 10 go build -trimpath -ldflags "$ldf" -o "$DEST/.$name.tmp.$$" "$pkg")
  mv -f "$DEST/.$name.tmp.$$" "$DEST/$name"
  say "built $name in $((SECONDS - t0))s"
}
for b in "${WANT[@]}"; do
  case $b in
    kube-apiserver) build kube-apiserver kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$LDF" \
                      "cold build, ~6 min on 2 cores" ;;
    etcd) build etcd etcd . "-s -w" "cold build, ~1 min after kube-apiserver, ~3 min alone" ;;
    helm) build helm helm helm.sh/helm/v4/cmd/helm \
            "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM" "cold build, ~6 min on 2 cores" ;;
    *) say "unknown binary $b"; exit 2 ;;
  esac
done
ln -sfn "$DEST" "$TB/bin"
for b in "${WANT[@]}"; do
  case $b in
    kube-apiserver) say "$("$TB/bin/kube-apiserver" --version)" ;;
    etcd) say "$("$TB/bin/etcd" --version | head -1)" ;;
    helm) say "helm $("$TB/bin/helm" version --short)" ;;
  esac
done
say "ready: $TB/bin -> $(readlink "$TB/bin") (total ${SECONDS}s)"
