"""`benchmarks/kernel_cache.py`: the GPU host's kernel caches packed into returnable parts and unpacked again."""

import os

from benchmarks.kernel_cache import load, save


def _cache(root, sizes):
    for name, size in sizes.items():
        d = root / name / "ab12"
        d.mkdir(parents=True)
        (d / "kernel.bin").write_bytes(os.urandom(size))  # incompressible, so the sizes below hold
        (d / "meta.json").write_text(f'{{"name": "{name}"}}')


def test_saved_caches_load_into_an_empty_machine_and_keep_what_is_there(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _cache(old, {"triton": 3000, "inductor": 2000})
    assert "saved triton, inductor" in save(tmp_path / "parts", root=old, max_mib=1, part_mib=1)
    (new / "triton" / "ab12").mkdir(parents=True)
    (new / "triton" / "ab12" / "meta.json").write_text("kept")  # already on the machine: not overwritten
    assert load(tmp_path / "parts", root=new).startswith("loaded")
    assert (new / "triton" / "ab12" / "kernel.bin").read_bytes() == (old / "triton" / "ab12" / "kernel.bin").read_bytes()
    assert (new / "inductor" / "ab12" / "kernel.bin").stat().st_size == 2000
    assert (new / "triton" / "ab12" / "meta.json").read_text() == "kept"


def test_over_the_budget_triton_alone_is_kept_then_nothing(tmp_path):
    root = tmp_path / "cache"
    _cache(root, {"triton": 300_000, "inductor": 900_000})
    assert save(tmp_path / "a", root=root, max_mib=1, part_mib=1).startswith("saved triton:")
    _cache(tmp_path / "big", {"triton": 2_000_000})  # one entry larger than the budget
    assert save(tmp_path / "b", root=tmp_path / "big", max_mib=1).startswith("nothing saved")
    assert not (tmp_path / "b").exists()
    assert load(tmp_path / "b", root=tmp_path / "new") == f"no saved kernel cache in {tmp_path / 'b'}"


def test_a_triton_cache_over_the_budget_keeps_its_most_recently_used_entries(tmp_path):
    """Five 300-kB entries (incompressible) and a 1-MiB budget: the three touched last are saved, the two oldest are
    not, and what is saved loads back whole."""
    root = tmp_path / "cache" / "triton"
    for i, name in enumerate(["e0", "e1", "e2", "e3", "e4"]):
        (root / name).mkdir(parents=True)
        kernel = root / name / "kernel.bin"
        kernel.write_bytes(os.urandom(300_000))
        os.utime(kernel, (1000 + i * 10, 1000 + i * 10))
        os.utime(root / name, (1000 + i * 10, 1000 + i * 10))
    os.utime(root / "e0" / "kernel.bin", (5000, 1000))  # the oldest compile, read last: kept
    message = save(tmp_path / "parts", root=tmp_path / "cache", max_mib=1, part_mib=1)
    assert message.startswith("saved the 3 newest of 5 triton entries"), message
    assert load(tmp_path / "parts", root=tmp_path / "new").startswith("loaded")
    assert sorted(p.name for p in (tmp_path / "new" / "triton").iterdir()) == ["e0", "e3", "e4"]
    assert (tmp_path / "new" / "triton" / "e4" / "kernel.bin").read_bytes() == (root / "e4" / "kernel.bin").read_bytes()
