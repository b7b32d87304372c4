#!/usr/bin/env bash
# Pack etcd and kube-apiserver for a GPU machine that gets the working tree plus a few carried
# files (scripts/gpu_e2e.py --apiserver DIR reads <name>.xz beside or instead of the binaries
# and decompresses them into its work directory at start).
#
# Owns: writing OUTDIR/etcd.xz and OUTDIR/kube-apiserver.xz (xz -9e, two threads) from
# $TESTBIN_DIR (default testbin/bin, built by scripts/ensure-testbin.sh) and printing their
# sizes. Must not: touch the source binaries or anything outside OUTDIR.
#
# Usage: scripts/pack-apiserver.sh OUTDIR     (e.g. testbin/packed; then run gpu_e2e.py with
#        TESTBIN_DIR=OUTDIR and carry OUTDIR)
set -euo pipefail
out=${1:?usage: scripts/pack-apiserver.sh OUTDIR}
src=${TESTBIN_DIR:-$(dirname "$0")/../testbin/bin}
for name in etcd kube-apiserver; do
    if [[ ! -x $src/$name ]]; then
        echo "no $src/$name: run scripts/ensure-testbin.sh" >&2
        exit 1
    fi
done
mkdir -p "$out"
for name in etcd kube-apiserver; do
    xz -9e -T2 --keep --stdout "$src/$name" >"$out/$name.xz.tmp"
    mv "$out/$name.xz.tmp" "$out/$name.xz"
done
ls -l "$out/etcd.xz" "$out/kube-apiserver.xz"
du -cb "$out/etcd.xz" "$out/kube-apiserver.xz" | awk 'END { printf "total %d bytes (%.1f MiB)\n", $1, $1 / 1048576 }'
