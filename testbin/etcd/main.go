// Command etcd is a thin entrypoint, identical to etcd's own server/main.go; it exists because
// `go install go.etcd.io/etcd/server/v3` is refused (that go.mod has replace directives).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
