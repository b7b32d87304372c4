#!/usr/bin/env bash
# Fetches (once) what builds the eBPF allocation guard (gpuguard/adapters/allocguard/): clang and
# llvm-strip (compile the BPF object, `clang -g -O2 -target bpf`), bpftool (writes vmlinux.h, the
# kernel's types for CO-RE, from /sys/kernel/btf/vmlinux) and libbpf's headers and static library
# (the loader extension links the shared one: Debian's libbpf.a is not position-independent, so
# it cannot go into a Python extension), from Debian 12's packages, unpacked into a cache outside the
# repo keyed by the versions. Prints BPF_TOOLS=<dir> as the last line of stdout (everything else
# goes to stderr); <dir>/bin has clang, llvm-strip and bpftool, <dir>/include the libbpf headers
# (<bpf/...>), <dir>/lib libbpf.so.1 (and libbpf.a). Idempotent: a warm cache costs three --version calls.
#
#   BPF_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-bpf)
#
# Nothing is installed system-wide: `apt-get download` fetches the .debs (verified by apt against
# the signed archive index) and `dpkg-deb -x` unpacks them; bin/ holds wrappers that point the
# loader at the unpacked libLLVM/libclang-cpp. The shared libraries those link against (libz3,
# libxml2, libedit, libffi, libelf, zlib) are Debian 12 base or near-base packages: a missing one
# makes the --version check below fail with the library's name. clang's own headers
# (libclang-common-14-dev) are not fetched: the BPF program includes only vmlinux.h and libbpf's.
set -euo pipefail
LLVM=1:14.0.6-12          # Debian 12 (bookworm): clang-14, llvm-14, libllvm14, libclang-cpp14
LIBBPF=1:1.1.2-0+deb12u1  # libbpf-dev (headers, libbpf.a), libbpf1 (libbpf.so.1)
BPFTOOL=7.1.0+6.1.192-3   # bpftool (from the linux source package)
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"

BASE=$(cache_root BPF_CACHE bpf)
KEY=$(printf '%s\n' "$LLVM" "$LIBBPF" "$BPFTOOL" | sha256sum | cut -c1-12)
DEST="$BASE/$KEY"
mkdir -p "$BASE"
works() {
  "$1/bin/clang" --version >/dev/null 2>&1 && "$1/bin/llvm-strip" --version >/dev/null 2>&1 \
    && "$1/bin/bpftool" --version >/dev/null 2>&1 && [[ -f $1/lib/libbpf.so.1 ]] \
    && [[ -f $1/include/bpf/libbpf.h ]]
}
if works "$DEST"; then
  say "cached ($DEST)"
else
  need_tools "needs a Debian-based system" apt-get dpkg-deb
  scratch_dir "$BASE" fetch
  pkgs=("clang-14=$LLVM" "libclang-cpp14=$LLVM" "libllvm14=$LLVM" "llvm-14=$LLVM"
    "libbpf-dev=$LIBBPF" "libbpf1=$LIBBPF" "bpftool=$BPFTOOL")
  say "downloading ${pkgs[*]}…"
  if ! (cd "$SCRATCH" && apt-get download -q "${pkgs[@]}") >&2; then
    # A fresh container has no package lists: update them, once, only when the download failed.
    say "download failed; running apt-get update and retrying"
    apt-get update -q >&2
    (cd "$SCRATCH" && apt-get download -q "${pkgs[@]}") >&2
  fi
  for deb in "$SCRATCH"/*.deb; do dpkg-deb -x "$deb" "$SCRATCH/root"; done
  out="$SCRATCH/out"
  mkdir -p "$out/bin" "$out/lib" "$out/include"
  mv "$SCRATCH/root/usr/lib/llvm-14" "$out/llvm-14"
  mv "$SCRATCH/root/usr/lib/x86_64-linux-gnu" "$out/lib/so"
  mv "$SCRATCH/root/usr/include/bpf" "$out/include/bpf"
  mv "$out/lib/so/libbpf.a" "$out/lib/libbpf.a"
  cp -L "$out/lib/so/libbpf.so.1" "$out/lib/libbpf.so.1"
  ln -s libbpf.so.1 "$out/lib/libbpf.so"
  mkdir -p "$out/libexec"
  mv "$SCRATCH/root/usr/sbin/bpftool" "$out/libexec/bpftool"
  # Wrappers: the unpacked LLVM libraries first on the loader's path, the host's untouched.
  wrap() {
    printf '%s\n' '#!/bin/sh' \
      "# $1 from the Debian package, with its unpacked libraries (scripts/ensure-bpf.sh)." \
      'here=$(dirname "$(readlink -f "$0")")/..' \
      "LD_LIBRARY_PATH=\"\$here/lib/so:\$here/llvm-14/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\" exec \"\$here/$2\" \"\$@\"" \
      >"$out/bin/$1"
    chmod 0755 "$out/bin/$1"
  }
  wrap clang llvm-14/bin/clang
  wrap llvm-strip llvm-14/bin/llvm-strip
  wrap bpftool libexec/bpftool
  works "$out" || die "the unpacked tools do not run: $("$out/bin/clang" --version 2>&1 | head -3)"
  rm -rf "$DEST"
  mv "$out" "$DEST" # one rename: the entry is complete or absent
  say "fetched in $((SECONDS - START))s"
fi
expect_version "$DEST/bin/clang" "clang version 14.0.6"
say "$("$DEST/bin/bpftool" --version 2>&1 | head -1)"
ln -sfn "$DEST" "$BASE/current"
say "ready: $DEST (total ${SECONDS}s)"
echo "BPF_TOOLS=$DEST"
