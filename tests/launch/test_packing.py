"""Packing whole: examples never cut (but one longer than a row), each attending only to itself with
its positions from 0, and a packed batch's loss the padded batch's.

The attention part runs a real tiny Llama in this process (SDPA on the CPU): the same examples as
padded rows and as rows packed whole give the same summed token loss; with the position ids or the
block mask taken away they do not, which is what makes the equality worth having.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.contract.data import DataPart, SourcePart
from launch.data.examples import SampleOrder, load_examples, micro_batch, prepare, read_stats, rows
from launch.data.rows import IGNORE, best_fit
from tests.conftest import VOCAB, make_llama


def part(path: Path, seq_len: int, pack, fmt: str = "tokens", shuffle: bool = False) -> DataPart:
    return DataPart(sources=[SourcePart(path=str(path), format=fmt)], seq_len=seq_len, batch_size=2,
                    micro_batch_size=1, shuffle=shuffle, pack=pack)


def tokens_file(path: Path, lengths: list[int], seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for n in lengths:
            ids = [rng.randrange(1, VOCAB) for _ in range(n)]
            labels = [t if rng.random() < 0.7 else IGNORE for t in ids]
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    return path


def test_rows_packed_whole_are_pinned(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in
                            ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20])))
    entry = prepare(part(data, 8, True), None, tmp_path / "c")
    ex = load_examples(entry)
    # Best fit in order: 3 + 5 fill row 0; 2 opens row 1; 10 is cut to a row of its own.
    assert ex.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0, 0, 0],
                                     [11, 12, 13, 14, 15, 16, 17, 18]]
    assert ex.labels.tolist() == [[IGNORE, 2, 3, IGNORE, 5, 6, 7, 8], [IGNORE, 10] + [IGNORE] * 6,
                                  [IGNORE, 12, 13, 14, 15, 16, 17, 18]]
    # Each example's positions from 0, and the padding after the last one from 0 again.
    assert ex.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert ex.lengths.tolist() == [8, 2, 8] and ex.targets.tolist() == [6, 1, 7]
    stats = read_stats(entry)
    assert stats["layout"] == "whole"
    assert {k: stats["train"][k] for k in ("examples", "rows", "truncated", "dropped_tokens", "padding_tokens")} == {
        "examples": 4, "rows": 3, "truncated": 1, "dropped_tokens": 2, "padding_tokens": 6}
    batch = micro_batch(ex, SampleOrder(3, 0, False), 0, 2, 0, 0, 1, 2)
    # A micro-batch of packed rows is one flattened row with its position ids and no attention mask.
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (1, 16)
    assert batch["position_ids"][0].tolist() == ex.positions[:2].reshape(-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_never_cuts_and_fills_the_rows(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 65, size=2000)
    row, col = best_fit(lengths, 64)
    used = np.zeros(row.max() + 1, int)
    np.add.at(used, row, lengths)
    assert (used <= 64).all() and (col + lengths <= 64).all()
    cells = {(int(r), int(c) + k) for r, c, n in zip(row, col, lengths) for k in range(n)}
    assert len(cells) == lengths.sum()  # no two examples share a token's place
    assert lengths.sum() / (64 * len(used)) > 0.9  # rows nearly full, in the given order


def test_text_stays_a_stream_unless_asked(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i] * 5}) + "\n" for i in range(1, 4)))
    assert part(data, 8, True).layout == "whole" and part(data, 8, None).layout == "pad"
    text = DataPart(sources=[SourcePart(path="d.txt", format="text")], seq_len=8, batch_size=1, micro_batch_size=1,
                    shuffle=False, pack=True)
    assert text.layout == "stream" and text.model_copy(update={"pack": "whole"}).layout == "whole"
    assert text.model_copy(update={"pack": None}).layout == "stream"


def _summed_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    count = int((batch["labels"][:, 1:] != IGNORE).sum())
    return model(**batch).loss * count


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(make_llama(tmp_path_factory.mktemp("m") / "llama", layers=2))
    assert model.config._attn_implementation == "sdpa"
    # As a phase's model: transformers reads packed position ids only without a KV cache.
    model.config.use_cache = False
    return model.eval()


def test_a_packed_batch_has_the_padded_batch_loss(tmp_path, llama):
    data = tokens_file(tmp_path / "t.jsonl", [5, 9, 3, 12, 7, 2, 16, 4, 6, 10, 1, 8])
    padded = load_examples(prepare(part(data, 16, False), None, tmp_path / "c"))
    packed = load_examples(prepare(part(data, 16, "whole", shuffle=True), None, tmp_path / "c"))
    assert len(packed) < len(padded) == 12
    with torch.no_grad():
        want = _summed_loss(llama, rows(padded, list(range(len(padded)))))
        batch = rows(packed, list(range(len(packed))))
        got = _summed_loss(llama, batch)
        assert abs(got - want) < 1e-5 * abs(want)
        # Without position ids the positions run on across examples (and so does the attention):
        crossed = _summed_loss(llama, {k: v for k, v in batch.items() if k != "position_ids"})
        assert abs(crossed - want) > 1e-3 * abs(want)  # a hundred times the tolerance above
        # With an attention mask transformers takes it as is: positions restart, attention crosses.
        everyone = _summed_loss(llama, batch | {"attention_mask": torch.ones_like(batch["input_ids"])})
        assert abs(everyone - want) > 1e-3 * abs(want)
