# Sourced (not run) by the scripts/ensure-*.sh that fetch or build a tool into a cache outside
# the repo: the pieces they share, so each states only what it fetches or builds.
#
# Owns: the progress lines (say, die: "[<script name> <seconds>s] text" on stderr, or on stdout
# where the script sets SAY_FD=1 before sourcing this), the Go build environment, the checks for
# needed tools, the cache root, a scratch directory removed on exit, and the version check and
# hand-over at the end of a run. Must not: fetch, build or print anything when sourced. The keys
# of the caches do not hash this file: a change to go_env must change each Go script's key too.
# ensure-buildkit.sh,
# ensure-chart-tools.sh, ensure-node.sh and ensure-python-base.sh hash their own text into their
# key, so they keep their own lines: a change here would not reach their keys.

START=$SECONDS
ENSURE_NAME=$(basename "$0" .sh)

# say TEXT...: one progress line, with the seconds since the script started.
say() { printf '[%s %4ds] %s\n' "$ENSURE_NAME" "$((SECONDS - START))" "$*" >&"${SAY_FD:-2}"; }

# die TEXT...: say it and exit 1.
die() {
  say "$*"
  exit 1
}

# go_env: the Go build environment of every cache: no workspace, no cgo, the local toolchain
# unless GOTOOLCHAIN names one, a module cache that `rm -rf` can clean, /usr/local/go/bin on PATH.
go_env() {
  export PATH="$PATH:/usr/local/go/bin"
  export GOWORK=off CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
  export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
}

# need_go: go on PATH (after go_env), else die.
need_go() {
  command -v go >/dev/null || die "go not found (need go1.26.x on PATH or /usr/local/go/bin)"
}

# need_tools WHY TOOL...: every TOOL on PATH, else die "TOOL not found (WHY)".
need_tools() {
  local why=$1 tool
  shift
  for tool in "$@"; do
    command -v "$tool" >/dev/null || die "$tool not found ($why)"
  done
}

# cache_root VAR NAME: $VAR when it is set and not empty, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-NAME.
cache_root() {
  local chosen=${!1:-}
  echo "${chosen:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-$2}"
}

# scratch_dir BASE KIND: SCRATCH=a new directory BASE/.KIND.XXXXXX, removed when the script exits.
# Work happens there and moves into the cache last, so an interrupted run never leaves a
# half-filled entry.
scratch_dir() {
  SCRATCH=$(mktemp -d "$1/.$2.XXXXXX")
  trap 'rm -rf "$SCRATCH"' EXIT
}

# expect_version BINARY TEXT: BINARY --version's first line contains TEXT, else die; say the line.
expect_version() {
  local got
  got=$("$1" --version 2>&1 | head -1)
  [[ $got == *"$2"* ]] || die "unexpected $(basename "$1") version: $got"
  say "$got"
}

# hand_over DEST BASE: point BASE/current at the entry DEST, say so, and print DEST as the last
# line of stdout (what the callers read).
hand_over() {
  ln -sfn "$1" "$2/current"
  say "ready: $1 (total ${SECONDS}s)"
  echo "$1"
}
