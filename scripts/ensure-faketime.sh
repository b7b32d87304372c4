#!/usr/bin/env bash
# Fetches (once) libfaketime, the LD_PRELOAD library that fakes one process's wall clock
# (docs/reliability.md R4: "wall clock jumps ±1 h" on the real enforcer), from Debian's
# `libfaketime` package, and builds next to it a 20-line companion (below), into a cache outside
# the repo keyed by the package version and the companion's source. Prints the directory that
# holds both (the last line of stdout; everything else goes to stderr); preload them in this
# order: LD_PRELOAD="<dir>/libmonotonic_sleep.so <dir>/libfaketimeMT.so.1".
# tests/integration/test_faults.py does, and steps the clock through FAKETIME_TIMESTAMP_FILE.
#
#   FAKETIME_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-faketime)
#
# Why the companion: with FAKETIME_DONT_FAKE_MONOTONIC=1 (a real NTP step moves CLOCK_REALTIME
# only), libfaketime 0.9.10 still shifts clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)'s
# deadline by the fake offset and the kernel answers EINVAL: Python >= 3.11's time.sleep fails
# (wolfcw/libfaketime#426, fixed after 0.9.10). The companion, preloaded first, sends the
# monotonic and boot-time clocks' sleeps straight to the kernel and every other one to
# libfaketime.
#
# Nothing is installed system-wide: `apt-get download` fetches the .deb (verified by apt against
# the signed archive index), `dpkg-deb -x` unpacks it, gcc builds the companion.
set -euo pipefail
VERSION=0.9.10-2.1 # Debian 12 (bookworm)
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"

read -r -d '' COMPANION <<'C' || true
/* Preloaded before libfaketime: monotonic sleeps bypass it (wolfcw/libfaketime#426). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *req,
                    struct timespec *rem) {
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (clock_id == CLOCK_MONOTONIC || clock_id == CLOCK_BOOTTIME) {
        return syscall(SYS_clock_nanosleep, clock_id, flags, req, rem) == 0 ? 0 : errno;
    }
    if (next == NULL) next = (int (*)(clockid_t, int, const struct timespec *,
                                      struct timespec *))dlsym(RTLD_NEXT, "clock_nanosleep");
    return next != NULL ? next(clock_id, flags, req, rem) : ENOSYS;
}
C

BASE=$(cache_root FAKETIME_CACHE faketime)
KEY=$(printf '%s\n%s' "$VERSION" "$COMPANION" | sha256sum | cut -c1-12)
DEST="$BASE/$VERSION-$KEY"
# Works when a process preloading both reads the faked wall clock and can sleep on the
# monotonic clock (`sleep` uses clock_nanosleep) with the monotonic clock left alone.
works() {
  local out
  out=$(FAKETIME="@2001-02-03 04:05:06" FAKETIME_DONT_FAKE_MONOTONIC=1 \
    LD_PRELOAD="$1/libmonotonic_sleep.so $1/libfaketimeMT.so.1" \
    bash -c 'sleep 0.01 && date -u +%Y' 2>&1) && [[ $out == 2001 ]]
}
mkdir -p "$BASE"
if [[ -f $DEST/libfaketimeMT.so.1 && -f $DEST/libmonotonic_sleep.so ]] && works "$DEST"; then
  say "cached ($DEST)"
else
  need_tools "needs Debian and a C compiler" apt-get dpkg-deb "${CC:-gcc}"
  scratch_dir "$BASE" fetch
  (cd "$SCRATCH" && apt-get download "libfaketime=$VERSION" >&2)
  dpkg-deb -x "$SCRATCH"/libfaketime_*.deb "$SCRATCH/root"
  mkdir "$SCRATCH/out"
  cp "$SCRATCH/root/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1" "$SCRATCH/out/"
  printf '%s\n' "$COMPANION" >"$SCRATCH/monotonic_sleep.c"
  "${CC:-gcc}" -O2 -Wall -Wextra -Werror -shared -fPIC -o "$SCRATCH/out/libmonotonic_sleep.so" \
    "$SCRATCH/monotonic_sleep.c" -ldl
  works "$SCRATCH/out" || die "the preloaded pair does not fake the clock as expected"
  rm -rf "$DEST"
  mv "$SCRATCH/out" "$DEST"
  say "fetched and built into $DEST"
fi
echo "$DEST"
