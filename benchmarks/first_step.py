"""Why a fresh phase's first step is slow on a GPU, and which warm-up before its go fixes it.

    python benchmarks/first_step.py --out DIR          # on a CUDA machine; ~2 min

Each variant is a fresh process: it pays DeepSpeed's one-time costs with a warm-up (or not),
then builds the 1.1B Llama's engine (bf16, ZeRO-2, head + one layer trainable, like a phase)
and times its first steps, forward / backward / optimizer step apart. Variants:

- none: no warm-up;
- toy: a 64x64 linear layer through a DeepSpeed engine (what relayer did first);
- layer: the model's own shape with one layer, through a DeepSpeed engine with the phase's
  config, one real step, then destroyed and the cache emptied;
- layer+cache: the same, the allocator's cache kept;
- eager: toy, with CUDA_MODULE_LOADING=EAGER.

Writes first_step.json and first_step.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
          "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
BATCH, SEQ = 4, 512

CHILD = r"""
import json, os, sys, time
import torch, deepspeed, transformers
from torch import nn
variant = sys.argv[1]
CONFIG, BATCH, SEQ = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(0)
deepspeed.init_distributed(dist_backend="nccl", verbose=False)
ds = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
      "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 1 << 30,
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 175_000_000, "allgather_bucket_size": 175_000_000}}

def model_of(layers):
    cfg = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.config.use_cache = False
    for name, p in m.named_parameters():
        p.requires_grad_(not name.startswith("model.layers.") or name.startswith("model.layers.0."))
    return m

def engine_of(m):
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
    return deepspeed.initialize(model=m, optimizer=opt, config=ds)[0]

def step(engine, timed):
    x = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), device="cuda")
    t0 = time.perf_counter()
    loss = engine(input_ids=x, labels=x).loss; torch.cuda.synchronize(); t1 = time.perf_counter()
    engine.backward(loss); torch.cuda.synchronize(); t2 = time.perf_counter()
    engine.step(); torch.cuda.synchronize(); t3 = time.perf_counter()
    if timed is not None:
        timed.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0})

t0 = time.perf_counter()
if variant in ("toy", "eager"):
    toy = nn.Linear(64, 64).to(torch.bfloat16)
    e = deepspeed.initialize(model=toy, optimizer=torch.optim.AdamW(toy.parameters()), config=ds)[0]
    e.backward(e(torch.zeros(BATCH, 64, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean()); e.step()
    e.destroy(); torch.cuda.synchronize(); torch.cuda.empty_cache()
elif variant.startswith("layer"):
    e = engine_of(model_of(1))
    step(e, None)
    e.destroy(); del e
    import gc; gc.collect()
    torch.cuda.synchronize()
    if variant == "layer":
        torch.cuda.empty_cache()
warm = time.perf_counter() - t0
m = model_of(CONFIG["num_hidden_layers"])
t0 = time.perf_counter()
engine = engine_of(m)
torch.cuda.synchronize()
build = time.perf_counter() - t0
steps = []
for _ in range(5):
    step(engine, steps)
print(json.dumps({"variant": variant, "warm_up_seconds": warm, "engine_seconds": build, "steps": steps,
                  "reserved_before_engine": None}), flush=True)
os._exit(0)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="none,toy,layer,layer+cache,eager")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, variant in enumerate(args.variants.split(",")):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29700 + i), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        if variant == "eager":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        proc = subprocess.run([sys.executable, "-c", CHILD, variant, json.dumps(CONFIG), str(BATCH), str(SEQ)],
                              env=env, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
        if line is None:
            results.append({"variant": variant, "error": proc.stderr[-2000:]})
            continue
        results.append(json.loads(line))
    (args.out / "first_step.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                          "results": results}, indent=1))
    lines = ["| variant | warm-up s | engine s | step 1 (fwd / bwd / opt) s | step 2 s | steady s |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][-300:]!r} | | | | |")
            continue
        s = r["steps"]
        first = s[0]
        lines.append(f"| {r['variant']} | {r['warm_up_seconds']:.2f} | {r['engine_seconds']:.3f} | "
                     f"{first['total']:.3f} ({first['forward']:.3f} / {first['backward']:.3f} / {first['step']:.3f}) | "
                     f"{s[1]['total']:.3f} | {sorted(x['total'] for x in s[2:])[len(s[2:]) // 2]:.3f} |")
    (args.out / "first_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
