"""What a manifest costs to read, load and walk: ordinary sizes up to the bound, and hostile ones.

Owns measurement only. ``check-pod`` and the pods file read user-supplied YAML through
``adapters.manifest``: before it, a 1 KB "billion laughs" ran 29 s
into a MemoryError and a 50 MB manifest ran past 300 s. Rows: ordinary multi-document manifests
of 256 KiB, 1 MiB and 16 MiB (the bound), then each hostile input, which must be refused in
well under a second. Best of ``--repeat`` runs, in one process (libyaml when PyYAML has it).

    .venv/bin/python -m benchmarks.manifest_bounds
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from functools import partial
from pathlib import Path

import yaml

from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    InputError,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
)
from rigs.measure import best_of
from rigs.provenance import header_lines

REPO = Path(__file__).resolve().parents[1]

POD = (REPO / "tests" / "fixtures" / "pods" / "valid.yaml").read_text(encoding="utf-8")


def _ordinary(size: int) -> bytes:
    copies = max(1, size // (len(POD) + 4))
    return ("---\n".join([POD] * copies)).encode()


def _laughs(levels: int) -> bytes:
    lines = ["kind: Pod", "x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    lines += ["metadata:", f"  namespace: *a{levels - 1}"]
    return ("\n".join(lines) + "\n").encode()


def _cases() -> list[tuple[str, bytes]]:
    return [
        ("ordinary 256 KiB", _ordinary(256 << 10)),
        ("ordinary 1 MiB", _ordinary(1 << 20)),
        ("ordinary 16 MiB (the bound)", _ordinary(MANIFEST_MAX_BYTES - (64 << 10))),
        ("billion laughs, 7 levels of 9", _laughs(7)),
        ("billion laughs, 9 levels of 9", _laughs(9)),
        ("10 KB of nested brackets", b"spec: " + b"[" * 5000 + b"]" * 5000),
        ("1 MiB of nested brackets", b"[" * (1 << 19) + b"]" * (1 << 19)),
        ("1 MiB sexagesimal number", b"n: 1" + b":0" * (1 << 19) + b"\n"),
        ("16 MiB + 1 byte", b"#" * (MANIFEST_MAX_BYTES + 1)),
    ]


def _run(path: Path) -> str:
    try:
        text = read_bounded(path, max_bytes=MANIFEST_MAX_BYTES, what="manifest")
        count = 0
        for number, document in enumerate(load_yaml_documents(text, where=str(path)), 1):
            count += sum(1 for _ in pod_manifests(document, where=f"document {number}"))
    except InputError as exc:
        return "refused: " + str(exc).split(": ", 1)[1][:60]
    return f"{count} objects"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("\n".join(header_lines()))
    print(
        f"python {platform.python_version()}, PyYAML {yaml.__version__}, "
        f"libyaml {'yes' if yaml.__with_libyaml__ else 'no'}, {platform.machine()}"
    )
    print(f"{'input':<30} {'bytes':>10} {'seconds':>9}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in _cases():
            path = Path(tmp) / "manifest.yaml"
            path.write_bytes(data)
            best, result = best_of(partial(_run, path), repeat=args.repeat)
            print(f"{name:<30} {len(data):>10} {best:>9.3f}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
