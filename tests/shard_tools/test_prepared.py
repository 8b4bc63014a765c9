"""Checkpoint files made ahead of their write (PreparedFiles) and the mapping reader (map_tensors)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from shard_tools.checkpoint import PreparedFiles, load_tensors, map_tensors, write_checkpoint
from shard_tools.manifest import HEAD, LAYERS, STATE
from shard_tools.errors import CheckpointError
from shard_tools.manifest import Manifest, verify_checkpoint
from shard_tools.store import Checkpoints


def manifest(step: int) -> Manifest:
    return Manifest(global_step=step, phase=0, layers=[1], phase_complete=True, head_step=step, body_step=step,
                    world_size=1, zero_stage=2, dtype="float32", files={}, versions={}, created=0.0)


def tensors(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        HEAD: {f"{k}/embed": torch.randn(300, 70, generator=g) for k in ("master", "exp_avg", "exp_avg_sq")}
        | {"master/norm": torch.randn(70, generator=g), "master/empty": torch.empty(0, 3)},
        LAYERS: {"layers.1.w": torch.randn(70, 70, generator=g)},
        STATE: {"global_step": torch.tensor([5])},
    }


def layouts(files):
    return {f: {n: (t.dtype, tuple(t.shape)) for n, t in files[f].items()} for f in (HEAD, LAYERS)}


META = {LAYERS: {"layers": "1", "layers_prefix": "layers"}}


def test_prepared_write_equals_plain_write(tmp_path):
    files = tensors(0)
    plain = write_checkpoint(tmp_path / "a", manifest(5), files, META).path
    prepared = PreparedFiles(tmp_path / "b", layouts(files), META)
    assert prepared.dir.name.startswith(".tmp-prepared.")
    # Half of the head goes in through its views (as the GPU gather does), the rest is copied.
    for name, t in list(files[HEAD].items())[:2]:
        prepared.views[HEAD][name].copy_(t)
        files[HEAD][name] = prepared.views[HEAD][name]
    written = write_checkpoint(tmp_path / "b", manifest(5), files, META, prepared=prepared)
    fast = written.path
    assert set(written.timing) == {"write", "fsync"} and all(v >= 0 for v in written.timing.values())
    for f in (HEAD, LAYERS, STATE):
        assert (plain / f).read_bytes() == (fast / f).read_bytes(), f
    assert verify_checkpoint(fast) == []
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp-*"))
    umask = os.umask(0)
    os.umask(umask)
    assert (fast / HEAD).stat().st_mode & 0o777 == 0o640 & ~umask  # the orchestrator's umask keeps it to the owner


def test_prepared_files_a_write_does_not_take_are_dropped(tmp_path):
    files = tensors(1)
    spare = {"spare.safetensors": {"x": (torch.float32, (3, 3))}}  # made ahead, then not written
    prepared = PreparedFiles(tmp_path, layouts(files) | spare, META)
    path = write_checkpoint(tmp_path, manifest(3), files, META, prepared=prepared).path
    assert sorted(p.name for p in path.iterdir()) == [HEAD, LAYERS, "manifest.json", STATE]
    assert verify_checkpoint(path) == []
    assert not prepared.dir.exists()


def test_prepared_that_does_not_fit_is_discarded(tmp_path):
    files = tensors(2)
    prepared = PreparedFiles(tmp_path, layouts(tensors(2)), META)
    files[HEAD]["master/norm"] = torch.zeros(71)  # another shape than prepared
    files[LAYERS]["layers.1.w"] = torch.zeros(70, 70, dtype=torch.bfloat16)
    path = write_checkpoint(tmp_path, manifest(4), files, META, prepared=prepared).path
    assert not prepared.dir.exists()
    assert torch.equal(load_file(path / HEAD)["master/norm"], torch.zeros(71))
    assert [p.name for p in Checkpoints(tmp_path).all()] == ["step-00000004"]


def test_prepare_on_a_full_disk_is_an_error_not_a_crash(tmp_path):
    # Files over 20 kB cannot grow: the prepared head (~250 kB) cannot be made; nothing is left.
    code = f"""
import resource, sys, torch
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[2])!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
from shard_tools.checkpoint import PreparedFiles
from shard_tools.errors import CheckpointError
try:
    PreparedFiles(__import__('pathlib').Path({str(tmp_path)!r}), {{"head.safetensors": {{"x": (torch.float32, (300, 200))}}}})
except CheckpointError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "could not prepare" in r.stdout
    assert not list((tmp_path / "checkpoints").iterdir())


def test_map_tensors_reads_what_was_written_and_never_writes_the_file(tmp_path):
    files = tensors(3)
    path = write_checkpoint(tmp_path, manifest(1), files, META).path
    before = (path / HEAD).read_bytes()
    mapped = map_tensors(path / HEAD)
    assert mapped.keys() == files[HEAD].keys()
    assert all(torch.equal(mapped[k], files[HEAD][k]) for k in mapped)
    for t in mapped.values():  # a private mapping: what a reader changes stays its own
        t.add_(1.0)
    assert (path / HEAD).read_bytes() == before
    assert load_tensors(path / LAYERS).keys() == map_tensors(path / LAYERS).keys()


def test_map_tensors_names_a_damaged_file(tmp_path):
    files = tensors(4)
    path = write_checkpoint(tmp_path, manifest(1), files, META).path
    head = path / HEAD
    data = head.read_bytes()
    head.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{head}: truncated"):
        map_tensors(head)
    head.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        map_tensors(head)
    with pytest.raises(CheckpointError, match="missing"):
        map_tensors(path / "nothing.safetensors")


def _rss_kb(address: int) -> int:
    """Resident kB of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds that address")


def test_map_tensors_without_populate_maps_pages_only_when_asked(tmp_path):
    from shard_tools.checkpoint import populate_pages

    g = torch.Generator().manual_seed(6)
    big = {HEAD: {"master/w": torch.randn(2_000_000, generator=g), "exp_avg/w": torch.randn(2_000_000, generator=g)}}
    path = write_checkpoint(tmp_path, manifest(2), big).path
    lazy = map_tensors(path / HEAD, populate=False)
    moments = lazy["exp_avg/w"]
    assert _rss_kb(moments.data_ptr()) < 1000  # 16 MB mapped, nothing of it in this process yet
    populate_pages([moments])
    assert _rss_kb(moments.data_ptr()) >= 7800  # its 8 MB now are (the page cache's own pages)
    assert torch.equal(moments, big[HEAD]["exp_avg/w"]) and torch.equal(lazy["master/w"], big[HEAD]["master/w"])


def test_populate_writable_maps_every_page_a_chunk_at_a_time(tmp_path):
    """The host path's offer file (``launch.hostpath.make_blob``) populated in chunks: every page of
    it in this process after, none before; a chunk that does not divide the size included."""
    import mmap

    from shard_tools.checkpoint import populate_writable

    size = 8 * 2**20 + 3 * mmap.PAGESIZE
    fd = os.open(tmp_path / "blob", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    whole = torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    os.close(fd)
    assert _rss_kb(whole.data_ptr()) < 100
    if not populate_writable(whole, chunk=3 * 2**20 + mmap.PAGESIZE):
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (older than 5.14)")
    assert _rss_kb(whole.data_ptr()) >= size // 1024
    assert os.stat(tmp_path / "blob").st_blocks * 512 >= size
