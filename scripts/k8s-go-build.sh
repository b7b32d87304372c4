# Sourced (not run) by ensure-testbin.sh and ensure-controlplane.sh after they set DEST (the
# cache entry), BASE, TB (testbin/), K8S (the Kubernetes version), COLD_BUILD_GIB (the disk a
# cold build needs) and say(): takes the entry's lock, sets LDF (the Kubernetes version stamped
# as the release's own build stamps it) and defines build(), which builds one Go binary of a
# testbin module into the entry unless it is there.
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
  command -v go >/dev/null || { say "go not found: cannot build $name"; exit 1; }
  if ((avail < COLD_BUILD_GIB + 2)); then
    say "warning: only ${avail} GiB free under $BASE (a cold build needs ~${COLD_BUILD_GIB} GiB)"
  fi
  say "building $name ($hint)…"
  # A temp name per process: a builder that did not take the lock (an older script) never
  # renames another's half-written file.
  (cd "$TB/$dir" && nice -n 10 go build -trimpath -ldflags "$ldf" -o "$DEST/.$name.tmp.$$" "$pkg")
  mv -f "$DEST/.$name.tmp.$$" "$DEST/$name"
  say "built $name in $((SECONDS - t0))s"
}
