"""Training data: text packed into examples, the token cache, the sample order, micro-batches.

The tokenizer is the tiny example's real one (a byte-level BPE that make_model.py trains).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoTokenizer

from launch.data.examples import DataError, Examples, SampleOrder, load_examples, micro_batch, prepare
from launch.data.tool import inspect
from launch.contract.data import DataPart, SourcePart
from tests.conftest import ROOT

DOCS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "On clear nights the beam reached far across the water.",
    "The island was small. A path ran from the landing to the tower, past a garden of potatoes and beans.",
    "Fog.",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, str(ROOT / "examples" / "tiny" / "make_model.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def load(part: DataPart, tokenizer: Path | str | None, cache: Path) -> torch.Tensor:
    """The prepared rows' input ids, as int64."""
    examples = load_examples(prepare(part, tokenizer and str(tokenizer), cache))
    return torch.from_numpy(np.array(examples.input_ids)).long()


def text_part(path: Path, seq_len: int) -> DataPart:
    return DataPart(sources=[SourcePart(path=str(path), format="text")], seq_len=seq_len, batch_size=8,
                    micro_batch_size=2, shuffle=True)


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n")
    return path


def packed_by_hand(tokenizer_dir: Path, docs: list[str], seq_len: int) -> tuple[torch.Tensor, int]:
    """(the examples, the tokens dropped): each document, then EOS, all in one stream, cut into rows."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = [t for doc in docs for t in tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len), len(stream) - n * seq_len


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_text_is_packed(tmp_path, tokenizer_dir, suffix):
    seq_len = 16
    path = tmp_path / f"train{suffix}"
    if suffix == ".txt":
        write_txt(path, DOCS)
    else:
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    examples = load(text_part(path, seq_len), tokenizer_dir, tmp_path / "cache")
    expected, dropped = packed_by_hand(tokenizer_dir, DOCS, seq_len)
    assert dropped > 0, "the case should have a remainder to drop"
    assert examples.dtype == torch.int64
    assert torch.equal(examples, expected)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ends, at = [], -1
    for doc in DOCS:
        at += len(tok(doc, add_special_tokens=False)["input_ids"]) + 1
        ends.append(at)
    # An EOS closes every document, wherever it falls; those past the last whole row are dropped.
    flat = examples.view(-1)
    assert (flat == tok.eos_token_id).nonzero().view(-1).tolist() == [e for e in ends if e < flat.numel()]


def test_the_data_tool_loads_no_tokenizer_for_data_prepared_already(tmp_path, tokenizer_dir):
    """A resume's data step (and plan after a run) finds its entry: no transformers import, no tokenizer."""
    tokenizer_dir = Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))  # broken below
    req = {"data": text_part(write_txt(tmp_path / "train.txt", DOCS), 16).model_dump(mode="json"),
           "tokenizer": str(tokenizer_dir), "cache_root": str(tmp_path / "cache"), "reuse": [], "show": 0,
           "vocab_size": None}
    probe = ("import json, sys; from launch.data.tool import inspect; a = inspect(json.load(sys.stdin)); "
             "print(json.dumps([a['stats']['train']['rows'], 'transformers' in sys.modules]))")
    runs = [subprocess.run([sys.executable, "-c", probe], input=json.dumps(req), capture_output=True, text=True,
                           cwd=ROOT, check=True) for _ in range(2)]
    (rows, loaded), (rows_again, loaded_again) = (json.loads(r.stdout) for r in runs)
    assert rows == rows_again > 0 and loaded and not loaded_again
    # A tokenizer whose files changed is another entry: loaded (and checked) again.
    (tokenizer_dir / "tokenizer.json").write_text("{}")
    broken = subprocess.run([sys.executable, "-c", probe], input=json.dumps(req), capture_output=True, text=True,
                            cwd=ROOT)
    assert broken.returncode != 0 and "cannot load a tokenizer" in broken.stderr


def test_the_data_tool_tokenizes_without_torch_as_with_it(tmp_path, tokenizer_dir):
    """``python -m launch.data.tool`` imports no torch (transformers does, where it is installed: 4.0 s
    of CPU against 1.7 s per tokenizer load), and prepares and shows the same as ``inspect`` in this
    process, which has torch."""
    req = {"data": text_part(write_txt(tmp_path / "train.txt", DOCS), 16).model_dump(mode="json"),
           "tokenizer": str(tokenizer_dir), "cache_root": str(tmp_path / "tool"), "reuse": [], "show": 3,
           "vocab_size": None}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "launch.data.tool"], input=json.dumps(req),
                       capture_output=True, text=True, cwd=ROOT, check=True)
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" in imported and "torch" not in imported
    assert not [line for line in r.stderr.splitlines() if not line.startswith("import time:")], r.stderr
    assert "torch" in sys.modules
    here = inspect({**req, "cache_root": str(tmp_path / "here")})
    assert json.loads(r.stdout) == json.loads(json.dumps(here)) and len(here["rows"]) == 3


def test_cache_is_reused_without_tokenizing(tmp_path, tokenizer_dir, monkeypatch):
    path = write_txt(tmp_path / "train.txt", DOCS)
    cache = tmp_path / "cache"
    first = load(text_part(path, 16), tokenizer_dir, cache)
    (cached,) = [p for p in cache.iterdir() if p.is_dir()]
    mtime = (cached / "rows.safetensors").stat().st_mtime_ns

    loads = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kw):
        loads.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    again = load(text_part(path, 16), tokenizer_dir, cache)
    assert torch.equal(again, first)
    assert loads == []
    entries = lambda: sorted(p for p in cache.iterdir() if p.is_dir())  # noqa: E731
    assert entries() == [cached] and (cached / "rows.safetensors").stat().st_mtime_ns == mtime

    # Another seq_len, or other text, is other examples: a new cache entry, tokenized again.
    load(text_part(path, 8), tokenizer_dir, cache)
    write_txt(path, DOCS[:3])
    load(text_part(path, 16), tokenizer_dir, cache)
    assert len(loads) == 2 and len(entries()) == 3
    assert (cached / "rows.safetensors").stat().st_mtime_ns == mtime


def test_too_little_text(tmp_path, tokenizer_dir):
    path = write_txt(tmp_path / "train.txt", ["Fog."])
    with pytest.raises(DataError, match=r"train\.txt: \d+ tokens, fewer than one example of data.seq_len = 512"):
        load(text_part(path, 512), tokenizer_dir, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_text_needs_a_tokenizer(tmp_path):
    path = write_txt(tmp_path / "train.txt", DOCS)
    with pytest.raises(DataError, match=r'needs a tokenizer: model.tokenizer \(default model.path\)'):
        load(text_part(path, 16), tmp_path, tmp_path / "cache")


def test_sample_order_is_a_function_of_seed_and_index():
    n = 10
    forward = SampleOrder(n, seed=3, shuffle=True)
    a = [forward[g] for g in range(5 * n)]
    # Random access (as a resumed run does, or another rank) sees the same order.
    backward = SampleOrder(n, seed=3, shuffle=True)
    assert [backward[g] for g in reversed(range(5 * n))] == a[::-1]
    epochs = [a[e * n:(e + 1) * n] for e in range(5)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 5, "each epoch should be shuffled afresh"
    assert [SampleOrder(n, seed=4, shuffle=True)[g] for g in range(n)] != epochs[0]
    assert [SampleOrder(n, seed=3, shuffle=False)[g] for g in range(3 * n)] == list(range(n)) * 3


def _step(examples, order, step, batch, world, mb) -> torch.Tensor:
    """Every rank's micro-batches of one optimizer step, in (micro-step, rank) order."""
    return torch.cat([micro_batch(examples, order, step, batch, micro, rank, world, mb)["input_ids"]
                      for micro in range(batch // (mb * world)) for rank in range(world)])


@pytest.mark.parametrize("world,mb", [(2, 2), (2, 4), (4, 1), (4, 2)])
def test_micro_batches_of_all_ranks_are_the_step_of_one_rank(world, mb):
    n, batch = 13, 8
    # Row i holds i, so a batch shows which examples it took.
    examples = Examples.of(torch.arange(n).view(n, 1).numpy())
    order = SampleOrder(n, seed=0, shuffle=True)
    for step in range(4):  # 32 samples over 13 examples: steps cross epoch boundaries
        one = _step(examples, order, step, batch, 1, 4)
        assert torch.equal(_step(examples, order, step, batch, world, mb), one)
        assert one.view(-1).tolist() == [order[g] for g in range(step * batch, (step + 1) * batch)]
