"""Move a large model file to the GPU host in pieces small enough for one transfer each, and join it there.

    python benchmarks/ship_model.py split FILE DIR [--part-mib 56]   # here: DIR/part-000 ... + DIR/manifest.json
    python benchmarks/ship_model.py join DIR OUT                      # there, once every part has arrived

A transfer to the host carries at most 64 MiB, and the host keeps what it received only while it stays warm, so the
parts are carried in back-to-back calls (one part directory each, e.g. `.gpu-bundle/ship/part-003/`). The manifest
holds a SHA-256 per part and of the whole file: `join` refuses a missing or corrupt part by name, so a dropped
transfer costs one re-send, never a run on a damaged model. `check` prints which parts are present and intact.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

MIB = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            digest.update(block)
    return digest.hexdigest()


def split(file: Path, out: Path, part_mib: int) -> dict:
    """`file` cut into `out/part-NNN/data` of at most `part_mib` MiB each, and `out/manifest.json`."""
    out.mkdir(parents=True, exist_ok=True)
    parts, size = [], file.stat().st_size
    with open(file, "rb") as f:
        for index in range((size + part_mib * MIB - 1) // (part_mib * MIB)):
            chunk = f.read(part_mib * MIB)
            where = out / f"part-{index:03d}"
            where.mkdir(exist_ok=True)
            (where / "data").write_bytes(chunk)
            parts.append({"dir": where.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"name": file.name, "bytes": size, "sha256": sha256_of(file), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def check(root: Path) -> list[str]:
    """The parts under `root` that are missing or whose bytes differ from the manifest (empty: all arrived)."""
    manifest = json.loads((root / "manifest.json").read_text())
    bad = []
    for part in manifest["parts"]:
        data = root / part["dir"] / "data"
        if not data.is_file() or data.stat().st_size != part["bytes"] or sha256_of(data) != part["sha256"]:
            bad.append(part["dir"])
    return bad


def join(root: Path, out: Path) -> Path:
    """The parts under `root` joined into `out` (a file, or a directory to put the original name in), checked
    part by part and as a whole; written to a temporary name and renamed, so a failed join leaves nothing."""
    manifest = json.loads((root / "manifest.json").read_text())
    bad = check(root)
    if bad:
        raise SystemExit(f"ship_model: parts missing or corrupt: {', '.join(bad)} (send them again)")
    target = out / manifest["name"] if out.is_dir() else out
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as f:
        for part in manifest["parts"]:
            f.write((root / part["dir"] / "data").read_bytes())
    if sha256_of(partial) != manifest["sha256"]:
        partial.unlink()
        raise SystemExit(f"ship_model: the joined file's SHA-256 differs from {manifest['sha256']}")
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("file", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--part-mib", type=int, default=56, help="at most this many MiB a part (default 56)")
    c = sub.add_parser("check")
    c.add_argument("root", type=Path)
    j = sub.add_parser("join")
    j.add_argument("root", type=Path)
    j.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        manifest = split(args.file, args.out, args.part_mib)
        print(f"{manifest['name']}: {manifest['bytes']} bytes, sha256 {manifest['sha256']}, "
              f"{len(manifest['parts'])} parts under {args.out}")
    elif args.command == "check":
        bad = check(args.root)
        print("all parts present and intact" if not bad else f"missing or corrupt: {', '.join(bad)}")
        return 1 if bad else 0
    else:
        print(join(args.root, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
