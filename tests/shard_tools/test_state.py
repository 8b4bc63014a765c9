"""shard_tools.state and shard_tools.store without a run: a phase's state written and read back
bitwise by the mirror pair, in the format every reader knows, older checkpoints read too, and a
run's checkpoints found, composed, kept and set aside by the store."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open

from shard_tools.errors import CheckpointError, InputError
from shard_tools.manifest import BODY_OPTIM, FINAL, HEAD, LAYERS, MANIFEST, STATE, read_manifest
from shard_tools.model import ModelSpec
from shard_tools.state import (
    KEPT_KEYS, OPTIM_KEYS, Origin, PhaseState, RunState, StateFiles, kept_state, load_state, run_weights, save_state,
)
from shard_tools.store import Checkpoints, Purged

ORIGIN = Origin(base_model=ModelSpec(path="/models/tiny", config=None, dtype="float32", seed=3), tokenizer=None,
                persistent=["model.norm"], layers_attr="model.layers", world_size=2, zero_stage=2)
HEAD_SHAPES = {"model.norm.weight": (4,)}


def layer_shapes(layers: list[int]) -> dict[str, tuple[int, ...]]:
    return {f"model.layers.{i}.w": (2, 3) for i in layers}


def state(step: int, phase: int, layers: list[int], complete: bool = True, seed: int = 0) -> PhaseState:
    g = torch.Generator().manual_seed(seed)

    def rand(shape):
        return torch.randn(shape, generator=g)

    masters = {n: rand(s) for n, s in layer_shapes(layers).items()}
    return PhaseState(
        step=step, phase=phase, layers=layers, phase_complete=complete, head_step=step, body_step=step % 7,
        head={k: {n: rand(s) for n, s in HEAD_SHAPES.items()} for k in OPTIM_KEYS}, masters=masters,
        run=RunState(data_position=8 * step, rng={"cpu.rank0": torch.get_rng_state(), "cpu.rank1": torch.get_rng_state()},
                     scaler={"cur_scale": 1024.0, "cur_iter": 37.0}),
        body=None if complete else {k: {n: rand(t.shape) for n, t in masters.items()} for k in OPTIM_KEYS[1:]},
        lr=1e-3)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("complete", [True, False])
def test_what_save_state_writes_load_state_reads_back_bitwise(tmp_path, complete):
    before = state(10, 1, [0, 2], complete)
    path = save_state(tmp_path, before, ORIGIN).path
    assert Checkpoints(tmp_path).faults(path) == []
    after, manifest = load_state(path)
    for field in ("step", "phase", "layers", "phase_complete", "head_step", "body_step", "lr"):
        assert getattr(after, field) == getattr(before, field), field
    assert same(after.head, before.head) and same(after.masters, before.masters)
    assert (after.body is None) if complete else same(after.body, before.body)
    assert after.run.data_position == 80 and after.run.scaler == before.run.scaler and same(after.run.rng, before.run.rng)
    mapped, _ = load_state(path, mapped=True)
    assert same(mapped.head, before.head) and manifest == read_manifest(path)


def kept(s: PhaseState, adam_step: int) -> PhaseState:
    """``s`` with its layers' kept Adam state (optimizer_state "keep")."""
    s.kept = {**{k: {n: t + i + 1 for n, t in s.masters.items()} for i, k in enumerate(KEPT_KEYS[:2])},
              "step": {n: torch.tensor([adam_step]) for n in s.masters}}
    return s


def test_kept_state_lies_beside_the_weights_composed_and_trimmed_with_them(tmp_path):
    """optimizer_state "keep": a phase end's layers file holds its layers' Adam state beside their
    masters ("<parameter>/<key>"); the weights' readers see the masters alone, ``kept_state`` the
    state of each layer's newest weights, also once retention trimmed their checkpoint."""
    first, second = kept(state(4, 0, [0, 1]), 4), kept(state(8, 1, [1], seed=1), 10)
    p1, p2 = (save_state(tmp_path, s, ORIGIN).path for s in (first, second))
    with safe_open(str(p2 / LAYERS), framework="pt") as f:
        assert sorted(f.keys()) == ["model.layers.1.w", *(f"model.layers.1.w/{k}" for k in KEPT_KEYS)]
    assert same(load_state(p1)[0].masters, first.masters)
    assert run_weights(tmp_path, p2).keys() == {"model.layers.0.w", "model.layers.1.w", "model.norm.weight"}
    store = Checkpoints(tmp_path)
    expected = {k: {"model.layers.0.w": first.kept[k]["model.layers.0.w"],
                    "model.layers.1.w": second.kept[k]["model.layers.1.w"]} for k in KEPT_KEYS}
    assert same(kept_state(store.layer_sources(p2)), expected)
    assert [p.removed for p in store.purge(1, set())] == [False]
    assert read_manifest(p1).kept_layers == [0]  # a trimmed copy, layer 1's older state gone with its weights
    assert same(kept_state(store.layer_sources(p2)), expected)
    assert same(kept_state({0: p1}), {k: {"model.layers.0.w": v["model.layers.0.w"]} for k, v in first.kept.items()})


def test_the_files_are_those_every_reader_knows(tmp_path):
    """The format is unchanged: readers of checkpoints written before (export, diff, verify, a
    resume) and after read the same names."""
    path = save_state(tmp_path, state(4, 0, [1], complete=False), ORIGIN).path
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, HEAD, LAYERS, BODY_OPTIM, STATE])
    names = {}
    for file in (HEAD, LAYERS, BODY_OPTIM, STATE):
        with safe_open(str(path / file), framework="pt") as f:
            names[file] = (sorted(f.keys()), f.metadata())
    assert names[HEAD][0] == [f"{k}/model.norm.weight" for k in ("exp_avg", "exp_avg_sq", "master")]
    assert names[LAYERS] == (["model.layers.1.w"], {"layers": "1", "layers_prefix": "model.layers"})
    assert names[BODY_OPTIM][0] == ["exp_avg/model.layers.1.w", "exp_avg_sq/model.layers.1.w"]
    assert names[STATE][0] == ["data_position", "global_step", "loss_scaler/cur_iter", "loss_scaler/cur_scale",
                               "rng/cpu.rank0", "rng/cpu.rank1"]
    m = json.loads((path / MANIFEST).read_text())
    assert m["extra"] == {"data_position": 32, "persistent": ["model.norm"], "tokenizer": None, "lr": 1e-3,
                          "base_model": {"path": "/models/tiny", "config": None, "dtype": "float32", "seed": 3},
                          "layers_attr": "model.layers"}
    assert (m["world_size"], m["zero_stage"], m["dtype"], m["phase_complete"]) == (2, 2, "float32", False)
    assert set(m["versions"]) == {"relayer", "torch", "deepspeed", "transformers", "safetensors", "python"}


def test_a_checkpoint_of_an_older_writer_loads(tmp_path):
    """Written before the loss scale was saved and before the manifest said the lr: no scaler,
    no lr, nothing else missing."""
    before = state(6, 0, [0])
    before.run.scaler, before.lr = {}, None
    path = save_state(tmp_path, before, ORIGIN).path
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["extra"]["lr"], manifest["extra"]["tokenizer"]
    (path / MANIFEST).write_text(json.dumps(manifest))  # the manifest is not among its own checksums
    after, _ = load_state(path)
    assert after.run.scaler == {} and after.lr is None and same(after.head, before.head)


def test_files_made_ahead_are_written_in_place(tmp_path):
    before = state(20, 1, [3])
    ahead = StateFiles(tmp_path, HEAD_SHAPES, layer_shapes([3]), [3], ORIGIN.layers_attr)
    for k, by_name in before.head.items():
        for n, t in by_name.items():
            ahead.head[k][n].copy_(t)
    prepared_dir = ahead.files.dir
    written = save_state(tmp_path, before, ORIGIN, prepared=ahead)
    assert not prepared_dir.exists() and ahead.files is None and ahead.head == {}  # renamed into place, used up
    after, _ = load_state(written.path)
    assert same(after.head, before.head) and same(after.masters, before.masters)


def run_of(tmp_path, *phases: tuple[int, list[int]]) -> Checkpoints:
    """Phase-end checkpoints, one a phase: (end step, layers)."""
    for k, (step, layers) in enumerate(phases):
        save_state(tmp_path, state(step, k, layers, seed=k), ORIGIN)
    return Checkpoints(tmp_path)


def test_layer_sources_and_retention_keep_what_the_kept_need(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [1]), (6, [0]), (8, [2]))
    assert store.layer_sources(store.at(8)) == {0: store.at(6), 1: store.at(4), 2: store.at(8)}
    assert list(store.purge(2, set())) == [Purged(store.at(4), removed=False), Purged(store.at(2), removed=True)]
    assert [c.name for c in store.all()] == ["step-00000004", "step-00000006", "step-00000008"]
    assert list(store.purge(2, set())) == []  # nothing more to do
    assert list(store.purge(1, {store.at(6)})) == [] and store.at(6).exists()


def test_layer_sources_skip_a_checkpoint_retention_removed_after_the_listing(tmp_path, monkeypatch):
    """A phase composing its layers lists the checkpoints, then reads their manifests, while the
    orchestrator's retention may remove one in between (found by CI: the 60-phase LISA run failed
    at phase 30 with "step-00000020/manifest.json: missing"). Retention removes none that a kept
    checkpoint composes from, so the sources are the same; a folder still there whose manifest is
    missing is another thing (it may have held a layer) and still raises."""
    store = run_of(tmp_path, (2, [0]), (4, [1]), (6, [0]), (8, [2]))
    listed = store.all()
    assert list(store.purge(2, set())) == [Purged(store.at(4), removed=False), Purged(store.at(2), removed=True)]
    monkeypatch.setattr(store, "all", lambda: listed)
    assert not store.at(2).exists()
    assert store.layer_sources(store.at(8)) == {0: store.at(6), 1: store.at(4), 2: store.at(8)}
    (store.at(4) / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="layer 1: step-00000008 composes it from step-00000004, which cannot "
                                              "be read .*step-00000004/manifest.json: missing"):
        store.layer_sources(store.at(8))


def test_retention_keeps_an_older_checkpoint_for_its_layers_alone(tmp_path):
    """Its head, state and body optimizer state go (never kept for its layers' sake); its layers file
    stays, vouched for by its manifest; the kept checkpoints compose the same weights; it is no
    restore point nor resume point, and a retention killed half-way is finished by the next."""
    store = run_of(tmp_path, (2, [0]), (4, [1]), (6, [0]), (8, [2]))
    before = run_weights(tmp_path, store.at(8)), run_weights(tmp_path, store.at(6))
    list(store.purge(2, set()))
    assert sorted(p.name for p in store.at(4).iterdir()) == [LAYERS, MANIFEST]
    m = read_manifest(store.at(4))
    assert m.layers_only and list(m.files) == [LAYERS] and m.layers == [1]
    assert store.faults(store.at(4)) == [] and "layers_only" not in (store.at(6) / MANIFEST).read_text()
    after = run_weights(tmp_path, store.at(8)), run_weights(tmp_path, store.at(6))
    assert all(same(a, b) for a, b in zip(before, after))
    (store.at(4) / HEAD).write_bytes(b"left by a killed retention")
    assert list(store.purge(2, set())) == [Purged(store.at(4), removed=False)]
    assert sorted(p.name for p in store.at(4).iterdir()) == [LAYERS, MANIFEST]
    (store.at(8) / HEAD).write_bytes(b"")
    assert store.restore_point().path == store.at(6)
    (store.at(6) / HEAD).write_bytes(b"")
    fresh = Checkpoints(tmp_path)  # trusts nothing it verified before
    assert fresh.restore_point().path is None and fresh.newest_whole()[0] is None
    with pytest.raises(InputError, match="holds layers only"):
        store.resume_point(store.at(4))


def test_a_layers_only_manifest_lists_its_layers_file(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [0]), (6, [1]))
    list(store.purge(1, set()))
    assert not store.at(2).exists()
    data = json.loads((store.at(4) / MANIFEST).read_text())
    assert data["layers_only"] is True and list(data["files"]) == [LAYERS]
    (store.at(4) / MANIFEST).write_text(json.dumps({**data, "files": {}}))
    assert "files: layers.safetensors is not listed; a layers-only checkpoint lists layers.safetensors" in \
        store.faults(store.at(4))[0]


def layers_held(ckpt) -> list[int]:
    m = read_manifest(ckpt)
    with safe_open(str(ckpt / m.layers_name), framework="pt") as f:
        return sorted({int(k.split(".")[2]) for k in f.keys()})


def test_retention_keeps_only_the_layers_no_kept_checkpoint_finds_newer(tmp_path):
    """The exact bound: an older checkpoint kept for its layers keeps only those a kept checkpoint
    composes from it, in a trimmed file of a new name (``layers-<checksum>.safetensors``), trimmed
    again as newer copies come; the records naming it (by the checksum its phase wrote) still hold,
    and every kept checkpoint composes the same weights. Before it, step 2's whole file stayed."""
    store = run_of(tmp_path, (2, [0, 1, 2]), (4, [1]), (6, [3]))
    before = run_weights(tmp_path, store.at(6)), run_weights(tmp_path, store.at(4))
    written = read_manifest(store.at(2)).files[LAYERS].sha256_chunked
    assert list(store.purge(2, set())) == [Purged(store.at(2), removed=False)]
    m = read_manifest(store.at(2))
    assert m.layers_only and m.kept_layers == [0, 2] and m.layers == [0, 1, 2] and m.written_sha256 == written
    assert list(m.files) == [m.layers_name] and m.layers_name == f"layers-{m.files[m.layers_name].sha256_chunked[:16]}.safetensors"
    assert sorted(p.name for p in store.at(2).iterdir()) == sorted([m.layers_name, MANIFEST])
    assert layers_held(store.at(2)) == [0, 2] and store.faults(store.at(2)) == []
    assert all(same(a, b) for a, b in zip(before, (run_weights(tmp_path, store.at(6)), run_weights(tmp_path, store.at(4)))))
    save_state(tmp_path, state(8, 3, [2], seed=3), ORIGIN)  # its record names step 2 by the checksum written
    assert json.loads((store.at(8) / MANIFEST).read_text())["layer_sources"]["0"]["sha256_chunked"] == written
    save_state(tmp_path, state(10, 4, [4], seed=4), ORIGIN)
    kept = run_weights(tmp_path, store.at(10)), run_weights(tmp_path, store.at(8))
    done = list(store.purge(2, set()))
    assert done == [Purged(store.at(k), removed=False) for k in (2, 4, 6)]
    assert layers_held(store.at(2)) == [0] and read_manifest(store.at(2)).written_sha256 == written
    assert layers_held(store.at(6)) == [3] and layers_held(store.at(4)) == [1]
    assert all(store.faults(c) == [] for c in store.all()) and store.source_faults(store.at(10)) == []
    assert all(same(a, b) for a, b in zip(kept, (run_weights(tmp_path, store.at(10)), run_weights(tmp_path, store.at(8)))))
    assert list(store.purge(2, set())) == []  # the bound is reached: nothing more to do


def test_a_trim_killed_at_any_point_leaves_every_checkpoint_whole_and_the_next_retention_ends_it(tmp_path, monkeypatch):
    """Killed after the trimmed copy is written (before the manifest, the commit point), or after
    the manifest (before the old file goes): every checkpoint verifies and composes as before, and
    the next retention finishes the work."""
    import shard_tools.store as store_module
    store = run_of(tmp_path, (2, [0, 1]), (4, [1]), (6, [2]))
    before = run_weights(tmp_path, store.at(6))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(store_module, "write_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        list(store.purge(2, set()))
    monkeypatch.undo()
    assert not read_manifest(store.at(2)).layers_only and store.faults(store.at(2)) == []
    assert len(list(store.at(2).glob("layers-*.safetensors"))) == 1  # the copy, listed by nothing
    assert same(run_weights(tmp_path, store.at(6)), before)
    monkeypatch.setattr(store_module, "_remove", killed)
    with pytest.raises(KeyboardInterrupt):
        list(store.purge(2, set()))
    monkeypatch.undo()
    assert read_manifest(store.at(2)).kept_layers == [0] and store.faults(store.at(2)) == []
    assert (store.at(2) / LAYERS).exists() and same(run_weights(tmp_path, store.at(6)), before)
    assert list(store.purge(2, set())) == [Purged(store.at(2), removed=False)]
    assert sorted(p.name for p in store.at(2).iterdir()) == sorted([read_manifest(store.at(2)).layers_name, MANIFEST])
    assert same(run_weights(tmp_path, store.at(6)), before)


def test_a_reader_holding_the_manifest_before_a_trim_reads_the_trimmed_file(tmp_path, monkeypatch):
    """A phase or ``shard-tools export`` composing while the orchestrator's retention trims a
    source: the file its manifest named is gone, so it reads the manifest again."""
    import shard_tools.state as state_module
    store = run_of(tmp_path, (2, [0, 1]), (4, [1]), (6, [2]))
    sources, before = store.layer_sources(store.at(6)), run_weights(tmp_path, store.at(6))
    old = {c: read_manifest(c) for c in store.all()}
    list(store.purge(2, set()))
    stale, real = [old[store.at(2)]], state_module.read_manifest
    monkeypatch.setattr(state_module, "read_manifest", lambda c: stale.pop() if c == store.at(2) and stale else real(c))
    got = state_module.layer_weights(sources)
    assert not stale  # the stale manifest was read, and its file was gone
    assert all(torch.equal(got[k], before[k]) for k in got) and {k for k in got if ".0." in k}


def test_a_trimmed_record_is_in_a_layers_only_manifest_alone(tmp_path):
    store = run_of(tmp_path, (2, [0, 1]), (4, [1]), (6, [2]))
    list(store.purge(2, set()))
    data = json.loads((store.at(2) / MANIFEST).read_text())
    (store.at(2) / MANIFEST).write_text(json.dumps({**data, "layers_only": False}))
    assert "written_sha256 and kept_layers: a trimmed layers file is recorded by both" in store.faults(store.at(2))[0]
    (store.at(2) / MANIFEST).write_text(json.dumps({k: v for k, v in data.items() if k != "kept_layers"}))
    assert "recorded by both" in store.faults(store.at(2))[0]


def test_retention_removes_nothing_where_an_older_manifest_is_unreadable(tmp_path):
    """Checkpoints written before the record (``Manifest.layer_sources``) compose by scanning the
    older manifests: one unreadable may have held a layer, so retention changes nothing. With the
    record, the kept checkpoint says what it composes: the unreadable one is left as it is."""
    store = run_of(tmp_path, (2, [0]), (4, [1]), (6, [0]))
    recorded = {c: (c / MANIFEST).read_text() for c in store.all()}
    for c, text in recorded.items():
        (c / MANIFEST).write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "layer_sources"}))
    (store.at(2) / MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match="may compose layers from it"):
        list(store.purge(1, set()))
    assert len(store.all()) == 3
    for c in (store.at(4), store.at(6)):
        (c / MANIFEST).write_text(recorded[c])
    assert list(store.purge(1, set())) == [Purged(store.at(4), removed=False)]
    assert len(store.all()) == 3 and (store.at(2) / MANIFEST).read_text() == "{"


def test_the_restore_point_skips_a_damaged_newer_checkpoint_and_trusts_what_it_verified(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [1]))
    data = bytearray((store.at(4) / HEAD).read_bytes())
    data[-1] ^= 0xFF
    (store.at(4) / HEAD).write_bytes(bytes(data))
    point = store.restore_point()
    assert point.path == store.at(2) and point.manifest.global_step == 2
    assert [(c, "checksum mismatch" in f) for c, f in point.skipped] == [(store.at(4), True)]
    assert store.trusted == {store.at(2)}


def test_a_resume_point_is_one_of_this_runs_and_whole(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [1]))
    assert store.resume_point(store.at(4)) == store.at(4)
    with pytest.raises(InputError, match="expected a checkpoint of this run"):
        store.resume_point(tmp_path)
    (store.at(2) / LAYERS).write_bytes(b"")
    with pytest.raises(InputError, match=r"step-00000004 is not whole:\n  .*layers.safetensors: size 0 bytes"):
        store.resume_point(store.at(4))


def test_setting_aside_moves_the_later_checkpoints_and_the_final_model(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [1]), (6, [2]))
    (tmp_path / FINAL).mkdir()
    aside = store.set_aside_after(store.at(2))
    assert aside.checkpoints == ["step-00000004", "step-00000006"] and (aside.folder / FINAL).is_dir()
    assert store.all() == [store.at(2)] and not (tmp_path / FINAL).exists() and store.at(2) in store.trusted
    assert store.set_aside_after(store.at(2)) is None


def test_the_newest_phase_end_written_since_a_time(tmp_path):
    store = run_of(tmp_path, (2, [0]), (4, [1]))
    since = time.time()
    save_state(tmp_path, state(6, 2, [2], complete=False), ORIGIN)  # mid-phase: no phase end
    assert store.newest_phase_end(6, since) is None
    assert store.newest_phase_end(6, 0.0) == store.at(4) and store.newest_phase_end(3, 0.0) == store.at(2)
