#!/usr/bin/env bash
# Fetches (once) h2load, nghttp2's HTTP load generator, from Debian's `nghttp2-client` package
# with the two libraries it needs that a slim Debian lacks (libev4, libjemalloc2), unpacked into
# a cache outside the repo keyed by the package version, and prints the path of a wrapper that
# runs it (the last line of stdout; everything else goes to stderr). benchmarks/metrics_load.py
# drives the metrics endpoint with it (a fixed request rate: `--rps`, which ab and wrk lack).
#
#   H2LOAD_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-h2load)
#
# Nothing is installed system-wide: `apt-get download` fetches the .debs (verified by apt against
# the signed archive index) and `dpkg-deb -x` unpacks them.
set -euo pipefail
VERSION=1.52.0-1+deb12u3 # Debian 12 (bookworm)
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"

BASE=$(cache_root H2LOAD_CACHE h2load)
DEST="$BASE/$VERSION"
mkdir -p "$BASE"
if [[ -x $DEST/h2load ]] && "$DEST/h2load" --version >/dev/null 2>&1; then
  say "cached ($DEST)"
else
  need_tools "needs a Debian-based system" apt-get dpkg-deb
  scratch_dir "$BASE" fetch
  (cd "$SCRATCH" && apt-get download "nghttp2-client=$VERSION" libev4 libjemalloc2 >&2)
  for deb in "$SCRATCH"/*.deb; do dpkg-deb -x "$deb" "$SCRATCH/root"; done
  cat >"$SCRATCH/root/h2load" <<'WRAP'
#!/usr/bin/env bash
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/usr/bin/h2load" "$@"
WRAP
  chmod +x "$SCRATCH/root/h2load"
  "$SCRATCH/root/h2load" --version >&2
  rm -rf "$DEST"
  mv "$SCRATCH/root" "$DEST"
  say "fetched into $DEST"
fi
echo "$DEST/h2load"
