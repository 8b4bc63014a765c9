"""Preparing data once: formats, file types, masks, packing, malformed records, the cache.

The tokenizer is made here: a word-level model trained with ``tokenizers`` on the test's own
sentences, with a small chat template, so every token and every mask can be written out by hand.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from launch.data import cache as dataprep, formats
from launch.data.examples import DataError, SampleOrder, load_examples, micro_batch, prepare, read_stats, training_rows
from launch.contract.data import DataPart, SourcePart

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<pad>", "<eos>", "[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
RECORDS = [
    {"instruction": "name a colour", "input": "", "output": "red"},
    {"instruction": "add the numbers", "input": "two and three", "output": "five"},
    {"instruction": "say hello", "input": "", "output": "hello there friend"},
    {"instruction": "name a fruit", "input": "not red", "output": "a yellow banana"},
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi friend"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"}]


def _tokenizer(out: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [r[k] for r in RECORDS for k in r] + [m["content"] for m in CHAT]
    words += [formats.ALPACA, "### Input: Response: Instruction: further context"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="[UNK]",
                                   additional_special_tokens=SPECIAL[3:])
    if template:
        fast.chat_template = template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)


@pytest.fixture(scope="module")
def plain_tok_dir(tmp_path_factory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("plain-tok"), None)


SOURCE_KEYS = ("train_on_prompt", "chat_template", "fields", "weight")


def part(path: Path, fmt: str, seq_len: int = 32, **kw) -> DataPart:
    """One source's data part; ``kw`` holds source keys (``SOURCE_KEYS``) and data keys."""
    source = SourcePart(path=str(path), format=fmt, **{k: v for k, v in kw.items() if k in SOURCE_KEYS})
    return DataPart(sources=[source], seq_len=seq_len, batch_size=2, micro_batch_size=1, shuffle=False,
                    **{k: v for k, v in kw.items() if k not in SOURCE_KEYS})


def rows_of(data: DataPart, tok: Path | None, cache: Path) -> list[tuple[list[str], list[str]]]:
    """Every row as (its tokens, its targets: the tokens at t >= 1 whose label is not -100)."""
    ex = load_examples(prepare(data, tok and str(tok), cache))
    t = AutoTokenizer.from_pretrained(tok) if tok else None
    out = []
    for ids, labels in training_rows(ex, SampleOrder(len(ex), 0, False), len(ex)):
        show = t.convert_ids_to_tokens if t else (lambda x: x)
        out.append((show(ids), show([x for x in labels[1:] if x != -100])))
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_mask_is_pinned_token_by_token(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    ((tokens, targets),) = rows_of(part(data, "chat"), tok_dir, tmp_path / "c")
    assert tokens == ["<|system|>", "be", "brief", "<|end|>", "<|user|>", "hello", "there", "<|end|>",
                      "<|assistant|>", "hi", "friend", "<|end|>", "<|user|>", "how", "are", "you", "<|end|>",
                      "<|assistant|>", "fine", "thanks", "<|end|>"]
    ex = load_examples(prepare(part(data, "chat"), str(tok_dir), tmp_path / "c"))
    t = AutoTokenizer.from_pretrained(tok_dir)
    labels = ex.labels[0, :len(tokens)].tolist()
    # Each assistant turn's content and its end-of-turn token; never its header, the system or user turns.
    assert [t.convert_ids_to_tokens(x) if x != -100 else None for x in labels] == [
        None, None, None, None, None, None, None, None,
        None, "hi", "friend", "<|end|>", None, None, None, None, None,
        None, "fine", "thanks", "<|end|>"]
    # ShareGPT is the same conversation.
    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CHAT]
    other = write_jsonl(tmp_path / "share.jsonl", [{"conversations": share}])
    assert rows_of(part(other, "chat"), tok_dir, tmp_path / "c") == [(tokens, targets)]
    # train_on_prompt: every token after the first is a target.
    ((_, all_targets),) = rows_of(part(data, "chat", train_on_prompt=True), tok_dir, tmp_path / "c")
    assert all_targets == tokens[1:]


def test_chat_template_from_the_schedule_overrides(tmp_path, plain_tok_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}])
    with pytest.raises(DataError, match="needs a chat template"):
        prepare(part(data, "chat"), str(plain_tok_dir), tmp_path / "c")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    ((tokens, targets),) = rows_of(part(data, "chat", chat_template=str(tmp_path / "t.jinja")), plain_tok_dir,
                                   tmp_path / "c")
    assert targets == ["hi", "friend", "<|end|>"]
    assert tokens[:2] == ["<|user|>", "hello"]


def test_instruction_with_a_chat_template(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    rows = rows_of(part(data, "instruction"), tok_dir, tmp_path / "c")
    assert rows[0] == (["<|user|>", "name", "a", "colour", "<|end|>", "<|assistant|>", "red", "<|end|>"],
                       ["red", "<|end|>"])
    # The input follows the instruction in the user turn.
    assert rows[1][0][:7] == ["<|user|>", "add", "the", "numbers", "two", "and", "three"]
    assert rows[1][1] == ["five", "<|end|>"]
    flipped = rows_of(part(data, "instruction", train_on_prompt=True), tok_dir, tmp_path / "c")
    assert flipped[0][1] == rows[0][0][1:]


def test_instruction_without_a_template_is_the_alpaca_prompt(tmp_path, plain_tok_dir):
    data = write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    rows = rows_of(part(data, "instruction", seq_len=64), plain_tok_dir, tmp_path / "c")
    t = AutoTokenizer.from_pretrained(plain_tok_dir)
    prompt = formats.ALPACA.format(context="", instruction="name a colour", input="")
    assert rows[0][0] == t.convert_ids_to_tokens(t(prompt)["input_ids"]) + ["red", "<eos>"]
    assert rows[0][1] == ["red", "<eos>"]
    assert "Input:" in rows[1][0] and rows[1][1] == ["five", "<eos>"]


def _write_all_types(tmp_path: Path, records: list[dict]) -> list[Path]:
    import datasets
    import pandas as pd
    import pyarrow as pa

    ds = datasets.Dataset.from_list(records)
    out = [write_jsonl(tmp_path / "t.jsonl", records)]
    (tmp_path / "array.json").write_text(json.dumps(records, indent=1))
    out.append(tmp_path / "array.json")
    out.append(write_jsonl(tmp_path / "lines.json", records))
    pd.DataFrame(records).to_parquet(tmp_path / "t.parquet")
    pd.DataFrame(records).to_csv(tmp_path / "t.csv", index=False)
    out += [tmp_path / "t.parquet", tmp_path / "t.csv"]
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    out.append(tmp_path / "t.arrow")
    ds.save_to_disk(str(tmp_path / "saved"))
    out.append(tmp_path / "saved")
    return out


def test_every_file_type_gives_the_same_rows(tmp_path, tok_dir):
    files = _write_all_types(tmp_path, RECORDS)
    expected = rows_of(part(files[0], "instruction"), tok_dir, tmp_path / "c")
    assert len(expected) == len(RECORDS)
    for f in files[1:]:
        assert rows_of(part(f, "instruction"), tok_dir, tmp_path / "c") == expected, f.name
    stats = read_stats(prepare(part(files[-1], "instruction"), str(tok_dir), tmp_path / "c"))["train"]
    assert (stats["examples"], stats["rows"], stats["truncated"]) == (4, 4, 0)


def test_text_records_and_txt(tmp_path, tok_dir):
    docs = ["hello there friend", "fine thanks"]
    txt = tmp_path / "d.txt"
    txt.write_text("\n\n".join(docs))
    records = write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in docs])
    a = rows_of(part(txt, "text", seq_len=3), tok_dir, tmp_path / "c")
    b = rows_of(part(records, "text", seq_len=3, fields={"text": "body"}), tok_dir, tmp_path / "c")
    # Packed: hello there friend <eos> | fine thanks <eos>; "fine" starts an example: no target.
    assert a == b == [(["hello", "there", "friend"], ["there", "friend"]), (["<eos>", "fine", "thanks"], ["thanks"])]


@pytest.mark.parametrize("name,content,fmt,where", [
    ("missing.jsonl", '{"instruction": "a", "output": "b"}\n\n{"instruction": "a"}\n', "instruction",
     r"missing\.jsonl:3: expected a \"output\" field holding a string"),
    ("badjson.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a", \n', "instruction",
     r"badjson\.jsonl:2: not valid JSON"),
    ("types.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "c"}\n'
     '{"instruction": "a", "output": 5}\n', "instruction", r"types\.jsonl:3: expected a \"output\" field"),
    ("array.json", '[{"instruction": "a", "output": "b"}, {"instruction": "a", "output": "b"}, {"instruction": 1}]',
     "instruction", r"array\.json: record 2: expected a \"instruction\" field"),
    ("text.json", '{"text": "hello"}\n{"content": "hello"}\n', "text", r"text\.json:2: expected a \"text\" field"),
    ("chat.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}\n', "chat",
     r"chat\.jsonl:1: turn 1: role \"bot\" is not one of"),
    ("tokens.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [1, 2], "labels": [1]}\n', "tokens",
     r"tokens\.jsonl:2: labels: expected a list of 2 token ids"),
    ("bad.csv", 'instruction,input,output\na,,b\n"two\nlines",,\n', "instruction",
     r"bad\.csv:3: expected a \"output\" field"),
    ("prose.txt", "just prose", "instruction", r"prose\.txt: a \.txt file is text"),
])
def test_malformed_records_name_file_and_line(tmp_path, tok_dir, name, content, fmt, where):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=where):
        prepare(part(path, fmt), str(tok_dir), tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == []


def test_a_csv_whose_outputs_are_numbers_is_text(tmp_path, tok_dir):
    """A CSV cell is text: "3" as an instruction's output was inferred a number and refused (#48)."""
    path = tmp_path / "sums.csv"
    path.write_text("instruction,input,output\nadd 1 and 2,,3\nadd 2 and 2,,4.0\n")
    assert len(rows_of(part(path, "instruction"), tok_dir, tmp_path / "c")) == 2


def test_not_utf8_names_the_file(tmp_path, tok_dir):
    for name in ("latin.jsonl", "latin.txt"):
        path = tmp_path / name
        path.write_bytes(b'{"text": "caf\xe9"}\n' if name.endswith("jsonl") else b"caf\xe9\n")
        with pytest.raises(DataError, match=rf"{name}.*not UTF-8"):
            prepare(part(path, "text"), str(tok_dir), tmp_path / "c")


def _tokens_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "t.jsonl", [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5, 6, 7], "labels": [4, 5, -100, 7]},
        {"input_ids": [8, 9, 10, 11, 12, 13, 14]},
    ])


def test_a_stream_keeps_labels_per_example(tmp_path):
    ex = load_examples(prepare(part(_tokens_file(tmp_path), "tokens", seq_len=5, pack="stream"), None, tmp_path / "c"))
    # Stream 1 2 3 | 4 5 6 7 | 8 ... 14; each example's first token is no target of the one before.
    assert ex.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 0]][:2]
    assert ex.labels.tolist() == [[-100, 2, 3, -100, 5], [-100, 7, -100, 9, 10]]
    assert ex.targets.tolist() == [3, 3]
    stats = read_stats(prepare(part(_tokens_file(tmp_path), "tokens", seq_len=5, pack="stream"), None,
                               tmp_path / "c"))["train"]
    assert (stats["rows"], stats["dropped_tokens"], stats["target_tokens"]) == (2, 4, 6)


def test_padding_and_truncation(tmp_path):
    data = part(_tokens_file(tmp_path), "tokens", seq_len=5)
    ex = load_examples(prepare(data, None, tmp_path / "c"))
    assert ex.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 0], [8, 9, 10, 11, 12]]
    assert ex.labels.tolist() == [[-100, 2, 3, -100, -100], [4, 5, -100, 7, -100], [8, 9, 10, 11, 12]]
    batch = micro_batch(ex, SampleOrder(3, 0, False), 0, 3, 0, 0, 1, 3)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].dtype == batch["input_ids"].dtype == batch["attention_mask"].dtype
    stats = read_stats(prepare(data, None, tmp_path / "c"))["train"]
    assert (stats["truncated"], stats["dropped_tokens"], stats["padding_tokens"]) == (1, 2, 3)


def _prepare_in_child(args) -> str:
    data, cache, log = args
    real = dataprep._build

    def counted(*a):
        with open(log, "a") as f:
            f.write("built\n")
        real(*a)

    dataprep._build = counted
    return str(prepare(data, None, Path(cache)))


def test_cache_is_made_once_and_mapped(tmp_path):
    data = part(_tokens_file(tmp_path), "tokens", seq_len=5)
    log = tmp_path / "builds.log"
    with multiprocessing.get_context("fork").Pool(3) as pool:
        dirs = pool.map(_prepare_in_child, [(data, str(tmp_path / "c"), str(log))] * 3)
    assert len(set(dirs)) == 1 and log.read_text() == "built\n"
    ex = load_examples(Path(dirs[0]))
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in (ex.input_ids, ex.labels))
    # A changed file (size or mtime) is another entry; the old one stays as it was.
    _tokens_file(tmp_path).write_text('{"input_ids": [1, 2, 3]}\n')
    again = prepare(data, None, tmp_path / "c")
    assert str(again) != dirs[0] and Path(dirs[0]).is_dir()
    shutil.rmtree(again)


def _prepare_forever(data, cache: str) -> None:
    def stuck(_data, _tokenizer, tmp, *_):
        (tmp / "rows.safetensors").write_bytes(b"half")
        time.sleep(600)

    dataprep._build = stuck
    prepare(data, None, Path(cache))


def test_a_killed_preparation_leaves_nothing_once_the_next_one_is_done(tmp_path):
    data = part(_tokens_file(tmp_path), "tokens", seq_len=5)
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / ".lock-0123456789abcdef0123").write_text("")  # what relayer before 2026-12 left
    child = multiprocessing.get_context("fork").Process(target=_prepare_forever, args=(data, str(cache)))
    child.start()
    deadline = time.time() + 60
    while not list(cache.glob(".tmp-*/rows.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert [p.name for p in cache.glob(".tmp-*")], "the killed preparation left its temporary"
    entry = prepare(data, None, cache)
    assert [p.name for p in cache.iterdir()] == [entry.name]
    assert read_stats(entry)["train"]["rows"] > 0


def test_an_entry_of_another_cache_is_taken_as_it_is(tmp_path):
    data = part(_tokens_file(tmp_path), "tokens", seq_len=5)
    theirs = prepare(data, None, tmp_path / "run-cache")
    assert prepare(data, None, tmp_path / "mine", reuse=(tmp_path / "elsewhere", tmp_path / "run-cache")) == theirs
    assert not (tmp_path / "mine").exists()
    mine = prepare(data, None, tmp_path / "mine", reuse=(tmp_path / "elsewhere",))  # nothing to take there
    assert mine.parent == tmp_path / "mine" and read_stats(mine) == read_stats(theirs)


def test_every_tokenizer_file_keys_the_cache(tmp_path, tok_dir):
    """added_tokens.json changes how text tokenizes, so another one is another cache entry."""
    tok = shutil.copytree(tok_dir, tmp_path / "tok")
    data = part(write_jsonl(tmp_path / "a.jsonl", RECORDS[:1]), "instruction")
    before = dataprep.cache_key(data, str(tok))
    (tok / "added_tokens.json").write_text(json.dumps({"<extra>": 7}))
    assert dataprep.cache_key(data, str(tok)) != before


def test_every_data_option_keys_the_cache(tmp_path, tok_dir):
    """Each option that changes the rows is another entry; the key a message names a source by is not."""
    a = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT}])
    base = DataPart(sources=[SourcePart(path=str(a), format="instruction"), SourcePart(path=str(b), format="chat")],
                    seq_len=32, batch_size=2, micro_batch_size=1, shuffle=True)
    keys = {dataprep.cache_key(base, str(tok_dir))}
    source = {"weight": 2.0, "train_on_prompt": True, "chat_template": "chatml", "fields": {"messages": "m"},
              "format": "text", "path": str(a)}
    for name, value in source.items():
        changed = base.sources[1].model_copy(update={name: value})
        keys.add(dataprep.cache_key(base.model_copy(update={"sources": (base.sources[0], changed)}), str(tok_dir)))
    for name, value in {"validation_split": 0.5, "seed": 1, "shuffle": False, "seq_len": 16, "pack": True,
                        "validation": (base.sources[0],)}.items():
        keys.add(dataprep.cache_key(base.model_copy(update={name: value}), str(tok_dir)))
    assert len(keys) == 1 + len(source) + 6
    renamed = base.sources[1].model_copy(update={"key": "data.sources[7]"})
    assert dataprep.cache_key(base.model_copy(update={"sources": (base.sources[0], renamed)}), str(tok_dir)) in keys


def test_every_source_has_the_record_checks_and_the_template_budget(tmp_path, tok_dir):
    """The hostile-input checks hold for each of several sources, not only the first: an id past
    the vocabulary is named by the second file's line, JSON nested too deep by its line, and a
    second source's own chat template fails naming that source's key."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"input_ids": [1, 2, 3]}] * 2)
    past = write_jsonl(tmp_path / "past.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, 500]}])
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"input_ids": [1, 2]}\n{"input_ids": ' + "[" * 150 + "]" * 150 + "}\n")

    def two(second: Path, fmt: str = "tokens", **kw) -> DataPart:
        return DataPart(sources=[SourcePart(path=str(good), format="tokens"),
                                 SourcePart(path=str(second), format=fmt, key="data.sources[1]", **kw)],
                        seq_len=8, batch_size=2, micro_batch_size=1, shuffle=False)

    with pytest.raises(DataError, match=rf"{past}:2: input_ids: token id 500 is not below the model's vocab_size 96"):
        prepare(two(past), None, tmp_path / "c1", vocab_size=96)
    with pytest.raises(DataError, match=rf"{deep}:2: a record nested more than 100 deep"):
        prepare(two(deep), None, tmp_path / "c2")
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.chat_template: "):
        prepare(two(chats, "chat", chat_template="{{ raise_exception('no') }}"), str(tok_dir), tmp_path / "c3")


def test_a_source_without_target_tokens_is_refused_naming_it(tmp_path):
    """Among several sources, one whose rows carry no loss is refused by its key (its weight buys
    nothing), as the whole training data without one is."""
    from launch.data import tool as datatool

    good = write_jsonl(tmp_path / "good.jsonl", [{"input_ids": [1, 2, 3]}] * 2)
    none = write_jsonl(tmp_path / "none.jsonl", [{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}] * 2)
    data = DataPart(sources=[SourcePart(path=str(good), format="tokens"),
                             SourcePart(path=str(none), format="tokens", key="data.sources[1]")],
                    seq_len=8, batch_size=2, micro_batch_size=1, shuffle=False)
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.path: no target tokens, nothing to train on: every label"):
        datatool.check(data, prepare(data, None, tmp_path / "c"), None)
    alone = data.model_copy(update={"sources": data.sources[1:]})
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.path: no target tokens"):
        datatool.check(alone, prepare(alone, None, tmp_path / "c"), None)
