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
SAY_FD=1 # progress lines on stdout, where its callers have always read them
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"
go_env
BASE=$(cache_root TESTBIN_CACHE testbin)
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
  need_go
  DEST="$BASE/$(key)"
  mkdir -p "$DEST"
fi
COLD_BUILD_GIB=6
# shellcheck source=scripts/k8s-go-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/k8s-go-build.sh"
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
