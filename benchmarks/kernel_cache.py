"""Carry the GPU host's compiled-kernel caches from one machine to the next, so a fresh machine does not compile
and autotune again what an earlier one did.

A fresh machine starts with empty caches: the first `agentrl train` step compiled for 43.5 s where a warm cache
gave 8.2 s, and fla's Triton autotuning on a cold cache took whole device calls (BENCHMARKS.md, history). The
caches live where `benchmarks/host_setup.sh` points them (`TRITON_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR` under
/tmp/kernel-cache). At the end of a device command, `save` packs them into parts small enough for a call's
returned files; here the parts are moved under `.gpu-bundle/kernel-cache/` (ignored), carried in one call of
the next lease, and `load` unpacks them before anything compiles.

    python3 benchmarks/kernel_cache.py save "$OUT/kcache"            # on the host, last in a command
    mv /work/.device/N/kcache .gpu-bundle/kernel-cache              # here
    python3 benchmarks/kernel_cache.py load .gpu-bundle/kernel-cache  # on the host (host_setup.sh does it)

A device call returns at most 8 files of 16 MiB (64 MiB together), logs included: `save` writes parts of 15 MiB
and leaves the inductor cache out when both caches together would pass `--max-mib` (Triton's holds the compiled
kernels and, since host_setup.sh sets TRITON_CACHE_AUTOTUNING on 2026-12-02, the autotuning results: the slow part
on a cold machine; caches saved before hold no autotuning results). Same GPU and software on both machines, or
the caches' own keys miss and nothing is lost but the transfer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks`

from benchmarks.ship_model import join, split  # noqa: E402

ROOT = Path(os.environ.get("AGENTRL_KERNEL_CACHE", "/tmp/kernel-cache"))
CACHES = ("triton", "inductor")  # subdirectories of ROOT, in the order they are kept when space is short
MIB = 1 << 20


def _packed(dirs: list[Path], archive: Path, entries: set[Path] | None = None) -> int:
    """`dirs` into a gzipped tar at `archive`; with `entries`, only those subfolders of them."""
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        for d in dirs:
            if entries is None:
                tar.add(d, arcname=d.name)
                continue
            for entry in sorted(e for e in d.iterdir() if e in entries):
                tar.add(entry, arcname=f"{d.name}/{entry.name}")
    return archive.stat().st_size


def _last_touched(entry: Path) -> float:
    """When an entry's files were last written or read (atime: Triton reads the kernel it serves from the cache).
    Folders count by their mtime only: listing a folder, as this does, moves its own access time."""
    files = [f for f in entry.rglob("*") if f.is_file()] if entry.is_dir() else [entry]
    return max([entry.stat().st_mtime] + [max(f.stat().st_mtime, f.stat().st_atime) for f in files])


def _bytes(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()) if entry.is_dir() else entry.stat().st_size


def save(out: Path, root: Path = ROOT, max_mib: int = 45, part_mib: int = 15) -> str:
    """Pack `root`'s caches into `out` (parts and a manifest, as `ship_model.split` writes them); what it kept.

    Both caches if they fit in `max_mib`, else Triton's alone, else Triton's most recently used entries (those this
    machine compiled or served), newest first, as many as fit: a cache that outgrew a call's returned files keeps
    what the latest runs needed rather than nothing."""
    present = [root / name for name in CACHES if (root / name).is_dir() and any((root / name).iterdir())]
    # Ordered before anything is packed: packing reads every file, which moves their access times to now.
    entries = sorted(present[0].iterdir(), key=_last_touched, reverse=True) if present else []
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "kernel-cache.tgz"
        for keep in (present, present[:1]):
            if not keep:
                break
            size = _packed(keep, archive)
            if size <= max_mib * MIB:
                split(archive, out, part_mib)
                return f"saved {', '.join(d.name for d in keep)}: {size / MIB:.1f} MiB in {out}"
        if not present:
            return "nothing saved: no cache"
        first = present[0]
        total = sum(_bytes(e) for e in entries)
        ratio = size / max(total, 1)  # compressed per raw byte, from the whole cache's archive just made
        budget = max_mib * MIB
        while budget > 0:
            chosen, used = set(), 0
            for e in entries:
                if used + _bytes(e) * ratio > budget:
                    break
                chosen.add(e)
                used += _bytes(e) * ratio
            if not chosen:
                break
            size = _packed([first], archive, chosen)
            if size <= max_mib * MIB:
                split(archive, out, part_mib)
                return (f"saved the {len(chosen)} newest of {len(entries)} {first.name} entries: {size / MIB:.1f} MiB "
                        f"in {out}")
            budget = int(budget * 0.9)
        return f"nothing saved: {', '.join(d.name for d in present)} over {max_mib} MiB"


def load(parts: Path, root: Path = ROOT) -> str:
    """Unpack saved parts into `root` (checked part by part by `ship_model.join`); files already there are kept."""
    if not (parts / "manifest.json").is_file():
        return f"no saved kernel cache in {parts}"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = join(parts, Path(tmp))
        with tarfile.open(archive) as tar:
            # filter="data" refuses paths that leave `root` and anything but plain files and folders
            members = [m for m in tar.getmembers() if m.name.split("/")[0] in CACHES and not (root / m.name).exists()]
            tar.extractall(root, members=members, filter="data")
    return f"loaded {len(members)} entries into {root}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save")
    s.add_argument("out", type=Path)
    s.add_argument("--max-mib", type=int, default=45)
    ld = sub.add_parser("load")
    ld.add_argument("parts", type=Path)
    args = parser.parse_args(argv)
    print(save(args.out, max_mib=args.max_mib) if args.command == "save" else load(args.parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
