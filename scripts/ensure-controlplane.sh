#!/usr/bin/env bash
# Builds (once) the rest of a real control plane for the chart-install test: kube-controller-manager
# and kube-scheduler (k8s.io/kubernetes v1.37.2, the same module and staging replaces as the API
# server) and kwok v0.8.0 (fake nodes and pods, no kubelet or images), from the Go wrapper modules
# testbin/control-plane and testbin/kwok, into a cache outside the repo keyed by go version +
# those module files: its own key, so the API server's cache (scripts/ensure-testbin.sh) is not
# invalidated. Idempotent: a warm cache costs a hash and three --version calls. The last line of
# stdout is `CONTROLPLANE_BIN=<dir>` (rigs/controlplane.py reads it; no link in the work tree).
#
#   CONTROLPLANE_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-controlplane)
#   CONTROLPLANE_ONLY="kwok"  build a subset (default: all three)
#   --init                    one-off, to bump versions (commit the result): recreate both
#                             wrapper modules through the Go module proxy, with the API server
#                             module's replace directives, and copy kwok's stage files
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB="$ROOT/testbin"
K8S=1.37.2
KWOK=v0.8.0
ALL=(kube-controller-manager kube-scheduler kwok)
read -r -a WANT <<<"${CONTROLPLANE_ONLY:-${ALL[*]}}"
SAY_FD=1 # progress lines on stdout, where its callers have always read them
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"
go_env
need_go

if [[ ${1:-} == --init ]]; then
  # The controller-manager and scheduler come from the very k8s.io/kubernetes the API server is
  # built from: same version, same staging replaces (testbin/kube-apiserver/go.mod).
  (cd "$TB" && rm -rf control-plane && mkdir control-plane && cd control-plane \
    && go mod init testbin/control-plane && go mod edit -go=1.26.0 \
    && sed -n 's/^replace \(.*\) => \(.*\) \(.*\)$/\1=\2@\3/p' ../kube-apiserver/go.mod \
       | while read -r r; do go mod edit -replace="$r"; done \
    && go get -tool "k8s.io/kubernetes/cmd/kube-controller-manager@v$K8S" \
                    "k8s.io/kubernetes/cmd/kube-scheduler@v$K8S" \
    && go mod tidy)
  (cd "$TB" && rm -rf kwok && mkdir kwok && cd kwok \
    && go mod init testbin/kwok && go mod edit -go=1.26.0 \
    && go get -tool "sigs.k8s.io/kwok/cmd/kwok@$KWOK" && go mod tidy \
    && S="$(go mod download -json "sigs.k8s.io/kwok@$KWOK" \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')/kustomize/stage" \
    && mkdir stages \
    && cp "$S"/node/fast/node-initialize.yaml \
          "$S"/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
          "$S"/pod/fast/pod-ready.yaml "$S"/pod/fast/pod-complete.yaml \
          "$S"/pod/fast/pod-delete.yaml stages/ \
    && chmod 644 stages/*)
  say "init done: commit testbin/control-plane and testbin/kwok"
  exit 0
fi
BASE=$(cache_root CONTROLPLANE_CACHE controlplane)
key() {
  { go version; echo "$K8S $KWOK"
    cat "$TB"/control-plane/go.mod "$TB"/control-plane/go.sum \
        "$TB"/kwok/go.mod "$TB"/kwok/go.sum; } | sha256sum | cut -c1-16
}
DEST="$BASE/$(key)"
mkdir -p "$DEST"
COLD_BUILD_GIB=4
# shellcheck source=scripts/k8s-go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/k8s-go-build.sh"
for b in "${WANT[@]}"; do
  case $b in
    kube-controller-manager)
      build kube-controller-manager control-plane k8s.io/kubernetes/cmd/kube-controller-manager \
        "$LDF" "cold build, ~3 min on 2 cores with the API server's Go build cache" ;;
    kube-scheduler)
      build kube-scheduler control-plane k8s.io/kubernetes/cmd/kube-scheduler "$LDF" \
        "cold build, ~1 min after kube-controller-manager" ;;
    kwok)
      build kwok kwok sigs.k8s.io/kwok/cmd/kwok \
        "-s -w" "cold build, ~2 min on 2 cores" ;;
    *) say "unknown binary $b"; exit 2 ;;
  esac
done
for b in "${WANT[@]}"; do
  say "$b: $("$DEST/$b" --version 2>&1 | head -1)"
done
say "ready (total ${SECONDS}s)"
echo "CONTROLPLANE_BIN=$DEST"
