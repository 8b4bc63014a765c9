"""Preparing an Alpaca-size data set once, and what its cache costs each process that maps it.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/data_prep.py --out benchmarks/results/DATE-data-prep-cpu

1. Writes a synthetic Alpaca-style file of 52,000 records (deterministic; outputs of 20-200 words,
   a third with an input) and the Alpaca example's tokenizer (its chat template renders them).
2. Times ``launch.data.cache.prepare`` (``datasets`` map over every core, one cache) against a
   single-process loop that renders and tokenizes record by record.
3. Starts 5 processes that map the cache as a run's do: 2 ranks that read their micro-batches of
   ``--steps`` optimizer steps, and 3 waiting phases that read one batch (their warm-up); while all
   are alive it reads each one's ``/proc/PID/smaps_rollup`` and reports the RSS and PSS the data
   added to it (after the imports and a first batch of zeros, before ``load_examples``), and the
   anonymous memory (the process's own copies: batches, the sample order). Goal: each at most 10%
   of the cache. RSS counts the shared page cache a process maps, and on kernels that cache files
   in large folios (here 6.18, ext4) one row read maps up to 2 MB of it; PSS splits that among the
   processes that map it.

Writes results.json in --out and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the a of to and in is it that for on with as by this be are from at or an which can will one all "
         "data model train layer step time value first each word answer number list more most other some such "
         "red blue green river stone cloud tree city market letter story music water light energy system").split()
TASKS = ["Summarize the following text.", "Write a short story about {w}.", "Explain why {w} matters.",
         "List three facts about {w}.", "Translate the sentence into plain words.", "Give advice on {w}."]
SEQ_LEN, BATCH, MICRO = 512, 32, 4


def write_records(path: Path, n: int, seed: int = 0) -> Path:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            task = rnd.choice(TASKS).format(w=rnd.choice(WORDS))
            context = " ".join(rnd.choices(WORDS, k=rnd.randint(10, 60))) if rnd.random() < 0.33 else ""
            output = " ".join(rnd.choices(WORDS, k=rnd.randint(20, 200))) + "."
            f.write(json.dumps({"instruction": task, "input": context, "output": output}) + "\n")
    return path


def make_tokenizer(out: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("alpaca_model", ROOT / "examples" / "alpaca" / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make(out)


def single_process_loop(data, tokenizer: str, path: Path) -> float:
    """Every record rendered and tokenized in this one process, one after the other."""
    from launch.data.cache import load_tokenizer
    from launch.data.formats import Encoder

    t0 = time.perf_counter()
    source = data.sources[0]
    tok = load_tokenizer(source, tokenizer)
    enc = Encoder(source, tok)
    with open(path) as f:
        for line in f:
            enc.encode(enc.format.sample(json.loads(line), tok))
    return time.perf_counter() - t0


WORKER = r"""
import json, sys
FIELDS = {"Rss:": "rss", "Pss:": "pss", "Anonymous:": "anonymous"}
import numpy as np
import torch
from launch.data.examples import Examples, SampleOrder, load_examples, micro_batch, rows, step_targets

def rollup():
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if parts[0] in FIELDS:
            out[FIELDS[parts[0]]] = int(parts[1]) * 1024
    return out

cache, rank, world, steps, batch, mb = sys.argv[1], int(sys.argv[2]), 2, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows(Examples.of(np.zeros((mb, 8), dtype=np.int32)), list(range(mb)))  # torch's first-call costs are not the data's
print(json.dumps(rollup()), flush=True)
examples = load_examples(cache)
order = SampleOrder(len(examples), 0, True)
for step in range(steps):
    step_targets(examples, order, step, batch)
    for micro in range(batch // (mb * world)):
        micro_batch(examples, order, step, batch, micro, rank % world, world, mb)
print("ready", flush=True)
sys.stdin.read()
"""


FIELDS = {"Rss:": "rss", "Pss:": "pss", "Anonymous:": "anonymous"}


def rollup(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in FIELDS:
                out[FIELDS[parts[0]]] = int(parts[1]) * 1024
    return out


def memory(cache: Path, steps: int) -> list[dict]:
    """Two ranks reading ``steps`` optimizer steps and three waiting phases reading one, alive together."""
    roles = [("rank 0", 0, steps), ("rank 1", 1, steps)] + [(f"waiting phase {i}", 0, 1) for i in (1, 2, 3)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(cache), str(rank), str(n), str(BATCH), str(MICRO)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _, rank, n in roles]
    try:
        before = [json.loads(p.stdout.readline()) for p in procs]
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        after = [rollup(p.pid) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    return [{"process": name, "steps_read": n, **{f"{k}_added": a[k] - b[k] for k in ("rss", "pss", "anonymous")}}
            for (name, _, n), b, a in zip(roles, before, after)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--records", type=int, default=52_000)
    p.add_argument("--steps", type=int, default=50, help="optimizer steps each rank reads")
    args = p.parse_args()
    from launch.data.cache import ROWS, prepare, read_stats
    from launch.contract.data import DataPart, SourcePart

    with tempfile.TemporaryDirectory(prefix="relayer-bench-data-") as tmp:
        tmp = Path(tmp)
        path = write_records(tmp / "alpaca-52k.jsonl", args.records)
        tokenizer = str(make_tokenizer(tmp / "model"))
        data = DataPart(sources=[SourcePart(path=str(path), format="instruction")], seq_len=SEQ_LEN,
                        batch_size=BATCH, micro_batch_size=MICRO, shuffle=True)
        t0 = time.perf_counter()
        cache = prepare(data, tokenizer, tmp / "cache")
        prepare_s = time.perf_counter() - t0
        loop_s = single_process_loop(data, tokenizer, path)
        size = (cache / ROWS).stat().st_size
        procs = memory(cache, args.steps)
        result = {
            "date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "versions": {k: importlib.metadata.version(k) for k in ("datasets", "tokenizers", "transformers", "torch",
                                                                   "numpy", "pyarrow")},
            "records": args.records, "file_bytes": path.stat().st_size, "seq_len": SEQ_LEN,
            "stats": read_stats(cache), "cache_bytes": size,
            "prepare_seconds": round(prepare_s, 2), "single_process_loop_seconds": round(loop_s, 2),
            "speedup": round(loop_s / prepare_s, 2),
            "batch_size": BATCH, "micro_batch_size": MICRO, "processes": procs,
            "max_pss_added_fraction_of_cache": round(max(q["pss_added"] for q in procs) / size, 4),
            "max_rss_added_fraction_of_cache": round(max(q["rss_added"] for q in procs) / size, 4),
            "max_anonymous_added_fraction_of_cache": round(max(q["anonymous_added"] for q in procs) / size, 4),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
