"""``shard-tools export``: a Hugging Face directory that loads to exactly the run's composed model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from shard_tools.state import run_weights
from shard_tools.export import COPIED_FILES, export
from shard_tools.header import tensor_headers
from tests.conftest import VOCAB, cli, make_llama, schedule_dict, write_schedule
from tests.shard_tools.conftest import assert_fails, ckpt, flip_byte, invoke, rewrite_manifests

IDS = torch.tensor([[(7 * i + 3) % VOCAB for i in range(16)]])


def _reference(run: Path, step: int, base_path: Path) -> torch.nn.Module:
    """Base model plus run_weights, built by hand: what an export must reproduce."""
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in run_weights(run, ckpt(run, step)).items():
            params[name].copy_(t)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def _no_temporaries(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".tmp-")]


def test_round_trip(tiny_run, tiny_model, tmp_path):
    out = tmp_path / "export"
    result = invoke("export", tiny_run, "--out", out)
    assert result.exit_code == 0, result.output
    assert str(ckpt(tiny_run, 30)) in result.stdout
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(exported), _logits(_reference(tiny_run, 30, tiny_model)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not torch.equal(_logits(exported), _logits(base))
    assert json.loads((out / "relayer.json").read_text())["global_step"] == 30
    assert _no_temporaries(tmp_path)


def test_a_checkpoint_sharded(tiny_run, tiny_model, tmp_path):
    out = tmp_path / "export"
    export(ckpt(tiny_run, 20), out, max_shard_size="50KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(exported), _logits(_reference(tiny_run, 20, tiny_model)))


def test_shards_hold_what_save_pretrained_writes(tiny_run, tmp_path, monkeypatch):
    """The shards are written by relayer's parallel writer (``shard_tools.shards``), tensor for
    tensor and name for name what transformers' own writer puts in them, and relayer.json's
    digests (taken as they were written) are the files'."""
    from safetensors import safe_open

    from shard_tools import shards
    from shard_tools.digest import folder_digests

    calls = []
    write = shards._write
    monkeypatch.setattr(shards, "_write", lambda path, *a: calls.append(path.name) or write(path, *a))
    out, plain = tmp_path / "export", tmp_path / "plain"
    export(ckpt(tiny_run, 20), out, max_shard_size="50KB")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and sorted(calls) == files
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(plain, max_shard_size="50KB")
    assert files == sorted(p.name for p in plain.glob("*.safetensors"))
    for name in files:
        with safe_open(out / name, "pt") as a, safe_open(plain / name, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys()) and a.metadata() == b.metadata() == {"format": "pt"}
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    index = "model.safetensors.index.json"
    assert json.loads((out / index).read_text())["weight_map"] == json.loads((plain / index).read_text())["weight_map"]
    assert json.loads((out / "relayer.json").read_text())["files"] == folder_digests(out, skip="relayer.json")


def test_dtype(tiny_run, tiny_model, tmp_path):
    """Composed in the export's dtype (never through a whole fp32 copy), each weight is the fp32
    composition rounded once."""
    out = tmp_path / "export"
    assert invoke("export", tiny_run, "--out", out, "--dtype", "bfloat16").exit_code == 0
    header, _ = tensor_headers(out / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert exported.dtype == torch.bfloat16
    want = _reference(tiny_run, 30, tiny_model).to(torch.bfloat16).state_dict()
    assert all(torch.equal(t, want[name]) for name, t in exported.state_dict().items())


def test_force_replaces_only_an_earlier_export(tiny_run, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    assert_fails(invoke("export", tiny_run, "--out", out), 2, out, "--force")
    assert_fails(invoke("export", tiny_run, "--out", out, "--force"), 2, out, "not one", "no relayer.json")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert invoke("export", tiny_run, "--out", out).exit_code == 0
    (out / "notes.txt").write_text("about this export\n")
    assert invoke("export", tiny_run, "--out", out, "--force").exit_code == 0
    assert not (out / "notes.txt").exists() and (out / "config.json").exists()
    assert _no_temporaries(tmp_path)
    # A folder inside is nothing an export writes: someone else's.
    (out / "mine").mkdir()
    assert_fails(invoke("export", tiny_run, "--out", out, "--force"), 2, out, "mine is a directory")
    assert (out / "mine").is_dir()


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` with its bytes (files), its target (links) or "dir"."""
    tree = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        tree[rel] = os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return tree


@pytest.fixture
def guarded(run_copy, tiny_model, tmp_path) -> tuple[Path, Path]:
    """(run, base): a run copy whose manifests name a base model copy that is itself an earlier export."""
    base = Path(shutil.copytree(tiny_model, tmp_path / "base"))
    (base / "relayer.json").write_text(json.dumps({"checkpoint": "/elsewhere/step-00000001", "global_step": 1}))
    rewrite_manifests(run_copy, lambda m: m["extra"]["base_model"].update(path=str(base)))
    return run_copy, base


OUTS = {
    "the run": lambda run, base: run,
    "the run's parent": lambda run, base: run.parent,
    "a checkpoint": lambda run, base: ckpt(run, 20),
    "inside a checkpoint": lambda run, base: ckpt(run, 20) / "export",
    "inside the run": lambda run, base: run / "export",
    "the base model": lambda run, base: base,
    "inside the base model": lambda run, base: base / "export",
    "a link to the run": lambda run, base: _link(run.parent / "link", run),
    "the checkpoints folder": lambda run, base: run / "checkpoints",
}


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("source", ["run", "checkpoint"])
@pytest.mark.parametrize("where", OUTS)
def test_out_never_replaces_what_it_exports_from(where, source, guarded, tmp_path):
    run, base = guarded
    out = OUTS[where](run, base)
    before = _tree(tmp_path)
    src = run if source == "run" else ckpt(run, 30)
    assert_fails(invoke("export", src, "--out", out, "--force"), 2, f"--out {out}")
    assert _tree(tmp_path) == before
    assert invoke("verify", run).exit_code == 0


def test_bad_max_shard_size(tiny_run, tmp_path):
    for size in ("abc", "0MB", "-5GB", "5 parsecs", ""):
        assert_fails(invoke("export", tiny_run, "--out", tmp_path / "out", "--max-shard-size", size), 2,
                     "--max-shard-size")
        assert list(tmp_path.iterdir()) == []
    assert invoke("export", tiny_run, "--out", tmp_path / "out", "--max-shard-size", "20KiB").exit_code == 0
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1


def test_out_through_a_symlink_loop(tiny_run, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert_fails(invoke("export", tiny_run, "--out", loop / "out"), 2, loop, "symbolic link loop")
    assert_fails(invoke("export", loop, "--out", tmp_path / "out"), 2, loop, "symbolic link loop")
    assert [p.name for p in tmp_path.iterdir()] == ["loop"]


def test_out_is_a_file(tiny_run, tmp_path):
    out = tmp_path / "export"
    out.write_text("a file\n")
    assert_fails(invoke("export", tiny_run, "--out", out, "--force"), 2, out, "not a directory")


def test_run_falls_back_to_its_newest_whole_checkpoint(run_copy, tmp_path):
    flip_byte(ckpt(run_copy, 30) / "head.safetensors")
    result = invoke("export", run_copy, "--out", tmp_path / "export")
    assert result.exit_code == 0, result.output
    assert str(ckpt(run_copy, 20)) in result.stdout
    # Said, not done quietly (#26); diff the same.
    warning = f"shard-tools: warning: {run_copy}: using step-00000020, not the newest: a newer checkpoint is damaged"
    assert warning in result.stderr
    result = invoke("diff", run_copy, ckpt(run_copy, 20))
    assert result.exit_code == 0 and warning in result.stderr, result.output


def test_a_full_disk_is_one_line_and_out_unchanged(tiny_run, tmp_path):
    """A file size limit stands for a full disk: every write past it fails with EFBIG."""
    import resource
    import signal
    import subprocess
    import sys

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = tmp_path / "export"
    r = subprocess.run([str(Path(sys.executable).parent / "shard-tools"), "export", str(tiny_run), "--out", str(out)],
                       capture_output=True, text=True, preexec_fn=limited, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"shard-tools: --out {out}: could not write the export (") and r.stderr.count("\n") == 1
    assert not out.exists() and _no_temporaries(tmp_path)


def test_refuses_a_damaged_layer_source(run_copy, tmp_path):
    # step-20 trained layer 1 only; its layer 0 comes from step-10.
    flip_byte(ckpt(run_copy, 10) / "layers.safetensors")
    result = invoke("export", ckpt(run_copy, 20), "--out", tmp_path / "export")
    assert_fails(result, 1, ckpt(run_copy, 10) / "layers.safetensors: checksum mismatch", "damaged")
    assert not (tmp_path / "export").exists() and _no_temporaries(tmp_path)


def test_base_model_gone(run_copy, tmp_path):
    gone = tmp_path / "moved-away"
    rewrite_manifests(run_copy, lambda m: m["extra"]["base_model"].update(path=str(gone)))
    result = invoke("export", run_copy, "--out", tmp_path / "export")
    assert_fails(result, 1, gone, "cannot build the base model")
    assert not (tmp_path / "export").exists()


def _save_tokenizer(model_dir: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(model_dir)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory, tiny_data) -> tuple[Path, Path]:
    """(run dir, base model dir) of a two-phase run of a tied-embedding model with a tokenizer."""
    d = tmp_path_factory.mktemp("tied")
    model = make_llama(d / "tied-llama", tie=True)
    _save_tokenizer(model)
    schedule = schedule_dict(model, tiny_data, schedule={"phases": [{"steps": 3, "layers": [0]},
                                                                    {"steps": 3, "layers": [2]}]})
    r = cli("orchestrator", "run", str(write_schedule(d / "schedule.toml", schedule)))
    assert r.returncode == 0, r.stderr
    return d / "run", model


def test_tied_embeddings_stay_tied(tied_run, tmp_path):
    run, base = tied_run
    out = tmp_path / "export"
    assert invoke("export", run, "--out", out).exit_code == 0
    header, _ = tensor_headers(out / "model.safetensors")
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    reference = _reference(run, 6, base)
    assert torch.equal(_logits(exported), _logits(reference))
    base_embedding = AutoModelForCausalLM.from_pretrained(base).model.embed_tokens.weight
    assert not torch.equal(exported.model.embed_tokens.weight, base_embedding)


def test_tokenizer_files_are_copied(tied_run, tmp_path):
    run, base = tied_run
    out = tmp_path / "export"
    export(run, out)
    copied = [n for n in COPIED_FILES if (base / n).exists()]
    assert "tokenizer.json" in copied
    for name in copied:
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out)("t1 t2")["input_ids"] == [1, 2]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_exports_files_share_one_mode(tied_run, tmp_path, umask):
    """Seen: the weights 0600 (safetensors' writer), the config 0644, the tokenizer as the base
    model's: every file gets what a new file gets under the umask (a run's final/: 0600)."""
    run, base = tied_run
    for name in COPIED_FILES:
        if (base / name).exists():
            os.chmod(base / name, 0o664)
    old = os.umask(umask)
    try:
        export(run, tmp_path / "export")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "export").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_the_runs_own_tokenizer_and_chat_template_are_copied(tied_run, tmp_path):
    run, base = tied_run
    manifest = json.loads(next((run / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["extra"]["tokenizer"] == str(base)  # model.tokenizer, by default model.path
    # A run whose model.tokenizer is a folder of its own, with a chat template beside it.
    copy, tok = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(run, copy)
    _save_tokenizer(tok)
    (tok / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rewrite_manifests(copy, lambda m: m["extra"].update(tokenizer=str(tok)))
    out = tmp_path / "export"
    export(copy, out)
    assert (out / "chat_template.jinja").read_bytes() == (tok / "chat_template.jinja").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(out).chat_template.startswith("{% for m in messages %}")


def test_the_chat_template_the_run_trained_with_is_saved(tied_run, tmp_path):
    """A run with a named ``data.chat_template`` (its checkpoints record the Jinja): the export's
    tokenizer has it, over the tokenizer folder's own (seen: RUN_DIR/final had none)."""
    run, _ = tied_run
    copy, tok = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(run, copy)
    _save_tokenizer(tok)
    (tok / "chat_template.jinja").write_text("the tokenizer's own")
    trained = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    rewrite_manifests(copy, lambda m: m["extra"].update(tokenizer=str(tok), chat_template=trained))
    out = tmp_path / "export"
    export(copy, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == trained
    assert tokenizer.apply_chat_template([{"role": "user", "content": "t1"}], tokenize=False) == "<user>t1"


def test_a_runs_own_final_folder_is_the_one_export_inside_it(tied_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tied_run[0], run)
    assert invoke("export", run, "--out", run / "final").exit_code == 0
    assert invoke("export", run, "--out", run / "final", "--force").exit_code == 0  # what a resumed run does
    assert json.loads((run / "final" / "relayer.json").read_text())["global_step"] == 6
    ckpt = sorted((run / "checkpoints").glob("step-*"))[0]
    for source, out in ((run, run / "finals"), (ckpt, run / "final"), (run, run / "final" / "x")):
        r = invoke("export", source, "--out", out, "--force")
        assert r.exit_code == 2 and "exports go outside" in r.output, (source, out, r.output)
