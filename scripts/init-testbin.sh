#!/usr/bin/env bash
# One-off: (re)creates testbin/*/go.mod, go.sum and etcd/main.go through the Go module proxy.
# Run it only to bump versions; commit the result. scripts/ensure-testbin.sh builds from them.
set -euo pipefail
K8S="${K8S:-1.37.2}"; STG="v0.${K8S#1.}"          # 1.37.2 -> v0.37.2
ETCD="${ETCD:-v3.6.16}"; HELM="${HELM:-v4.3.2}"
export GOWORK=off GOTOOLCHAIN=local GOFLAGS=-modcacherw
PATH="$PATH:/usr/local/go/bin"
cd "$(dirname "$0")/../testbin"

# fresh_module NAME: into testbin/NAME (made if missing), with a new go.mod and no go.sum.
fresh_module() {
  mkdir -p "$1" && cd "$1"
  rm -f go.mod go.sum
  go mod init "testbin/$1"
  go mod edit -go=1.26.0
}

echo "== kube-apiserver k8s.io/kubernetes v$K8S, staging $STG"
fresh_module kube-apiserver
KMOD=$(go mod download -json "k8s.io/kubernetes@v$K8S" \
       | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
awk '/=> \.\/staging\/src\/k8s\.io\//{print $1}' "$KMOD" | sort -u | while read -r m; do
  go mod edit -replace="$m=$m@$STG"
done
go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S"
go mod tidy
cd ..

echo "== etcd $ETCD"
fresh_module etcd
cat > main.go <<'GO'
// Command etcd is a thin entrypoint, identical to etcd's own server/main.go; it exists because
// `go install go.etcd.io/etcd/server/v3` is refused (that go.mod has replace directives).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
go get "go.etcd.io/etcd/server/v3@$ETCD"
go mod tidy
cd ..

echo "== helm $HELM"
fresh_module helm
go get -tool "helm.sh/helm/v4/cmd/helm@$HELM"
go mod tidy
echo "== init done"
