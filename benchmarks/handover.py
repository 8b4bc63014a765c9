"""How fast can a phase hand its state to its successor on the device (issue #18's floor)?

usage (a CUDA machine with DeepSpeed):  python benchmarks/handover.py --shape 1.1b --out results.json

Two unrelated processes on one GPU, with real DeepSpeed ZeRO-2 bf16 engines (torch AdamW):
- the successor starts first and pre-warms (imports, CUDA context, DeepSpeed's one-time costs on a
  one-layer model, the full model's structure on the device), then waits for its go on stdin;
- the predecessor builds its engine (head + 2 body layers trainable), trains a few steps, exports
  CUDA IPC handles (JSON, base64; no pickle) of every bf16 weight and of the head's fp32 master and
  Adam moments, and sends the go;
- the successor maps each storage, copies it into its own memory (copy, never alias), releases the
  mappings (``torch.cuda.ipc_collect``), builds its engine with its own body layers, puts the head's
  master and moments into it, answers "copied" and trains; the predecessor exits on that answer.

It records the timings of each piece, checks that every copied tensor equals its source bitwise
(float64 sums and a hash of the bytes taken on both sides), and the device memory at the overlap.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import time

SHAPES = {  # Llama shapes: TinyLlama-1.1B and Llama-2-7B
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=128),
}
HEAD = ("model.embed_tokens.", "lm_head.", "model.norm.")
BATCH, SEQ = 4, 512


def _now() -> float:
    return time.perf_counter()


def _build(shape: str, layers: int | None = None, init: bool = True):
    """The model on the device, randomly initialised, or (``init=False``) its structure only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SHAPES[shape], max_position_embeddings=2048, torch_dtype=torch.bfloat16)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(**kw)
    with torch.device("cuda" if init else "meta"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16) if init else model.to_empty(device="cuda").to(torch.bfloat16)


def _engine(model, body: list[int]):
    """A ZeRO-2 bf16 engine training the head and ``body``; param group 0 is the head's."""
    import deepspeed

    head, rest = [], []
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith(HEAD) or any(name.startswith(f"model.layers.{i}.") for i in body)
        if p.requires_grad:
            (head if name.startswith(HEAD) else rest).append(p)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=[{"params": head}, {"params": rest}])
    return engine


def _step(engine, seed: int) -> float:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, engine.module.config.vocab_size, (BATCH, SEQ), device="cuda", generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _head_state(engine) -> dict:
    """The head group's fp32 master and Adam moments (ZeRO-1/2: one flat tensor per group)."""
    opt = engine.optimizer
    flat = opt.single_partition_of_fp32_groups[0]
    st = opt.optimizer.state[flat]
    return {"master": flat, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}, st["step"]


def _fingerprint(t) -> str:
    import torch

    return f"{t.double().sum().item():.17g}/{hashlib.sha1(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]}"


def _export(name: str, t) -> dict:
    s = t.untyped_storage()
    dev, handle, size, off, rc, rc_off, ev, ev_sync = s._share_cuda_()
    b = lambda x: base64.b64encode(x).decode() if isinstance(x, bytes) else x  # noqa: E731
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "storage_offset": t.storage_offset(), "device": dev, "handle": b(handle), "size": size,
            "offset": off, "rc_handle": b(rc), "rc_offset": rc_off, "event": b(ev), "event_sync": ev_sync}


def _map(r: dict):
    import torch

    u = lambda x: base64.b64decode(x) if isinstance(x, str) else x  # noqa: E731
    st = torch.UntypedStorage._new_shared_cuda(r["device"], u(r["handle"]), r["size"], r["offset"], u(r["rc_handle"]),
                                               r["rc_offset"], u(r["event"]), r["event_sync"])
    t = torch.empty(0, dtype=getattr(torch, r["dtype"]), device="cuda")
    numel = 1
    for d in r["shape"]:
        numel *= d
    t.set_(st, r["storage_offset"], (numel,), (1,))
    return t.view(r["shape"])


def _copy_in(recs: list[dict], params: dict, buffers: dict, t: dict) -> dict:
    """Maps the predecessor's storages and copies them into this process's memory; the head's
    optimizer state comes back as new tensors. Nothing mapped outlives this function (a mapping
    kept alive, even by a loop variable, pins the predecessor's memory past its exit)."""
    import torch

    mapped = [(_map(r), r["name"]) for r in recs]
    torch.cuda.synchronize()
    t["mapped"] = _now()
    head = {}
    for m, name in mapped:
        if name.startswith("head/"):
            head[name[5:]] = m.clone()
        elif name.startswith("buffer/"):
            buffers[name[7:]].copy_(m)
        else:
            params[name].data.copy_(m)
    torch.cuda.synchronize()
    t["copied"] = _now()
    return head


def predecessor(args) -> None:
    import torch

    t = {"start": _now()}
    succ = subprocess.Popen([sys.executable, __file__, "--role", "succ", "--shape", args.shape,
                             "--steps", str(args.steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    model = _build(args.shape)
    engine = _engine(model, [0, 1])
    losses = [_step(engine, s) for s in range(args.steps)]
    torch.cuda.synchronize()
    t["trained"] = _now()
    state, step = _head_state(engine)
    recs = [_export(n, p.data) for n, p in engine.module.named_parameters()]
    recs += [_export(f"buffer/{n}", b) for n, b in engine.module.named_buffers()]  # rotary inv_freq
    recs += [_export(f"head/{k}", v) for k, v in state.items()]
    t["exported"] = _now()
    sums = {k: _fingerprint(v) for k, v in state.items()}
    weights = {n: _fingerprint(p.data) for n, p in list(engine.module.named_parameters())[:3]}
    ready = succ.stdout.readline()  # the successor is warm: its go may come
    t["succ_ready"] = _now()
    go = json.dumps({"tensors": recs, "step": float(step)})
    t["go"] = _now()
    succ.stdin.write(go + "\n")
    succ.stdin.flush()
    copied = json.loads(succ.stdout.readline())
    t["copied_seen"] = _now()
    del state, recs
    mem = torch.cuda.max_memory_allocated()
    out = json.loads(succ.stdout.readline())
    succ.wait()
    print(json.dumps({"shape": args.shape, "pred_losses": losses, "pred_peak_allocated_GB": round(mem / 2**30, 2),
                      "pred": {k: round(v - t["start"], 4) for k, v in t.items()},
                      "go_to_copied_seen_s": round(t["copied_seen"] - t["go"], 4),
                      "succ_warm": json.loads(ready), "succ_copied": copied, "succ": out,
                      "equal": {k: out["sums"][k] == v for k, v in sums.items()}
                      | {n: out["weights"][n] == v for n, v in weights.items()}}, indent=1))


def successor(args) -> None:
    t0 = _now()
    import deepspeed  # noqa: F401
    import torch
    import transformers  # noqa: F401

    torch.cuda.init()
    t_imports = _now() - t0
    warm = _engine(_build(args.shape, layers=1), [0])  # DeepSpeed's one-time costs, off the critical path
    _step(warm, 0)
    warm.destroy()
    del warm
    torch.cuda.empty_cache()
    model = _build(args.shape, init=False)
    torch.cuda.synchronize()
    print(json.dumps({"imports_s": round(t_imports, 2), "warm_s": round(_now() - t0, 2),
                      "free_GB": round(torch.cuda.mem_get_info()[0] / 2**30, 2)}), flush=True)

    go = json.loads(sys.stdin.readline())
    t = {"go_read": _now()}
    recs = go["tensors"]
    head = _copy_in(recs, dict(model.named_parameters()), dict(model.named_buffers()), t)
    overlap_free = torch.cuda.mem_get_info()[0]
    torch.cuda.ipc_collect()
    print(json.dumps({"t": time.time()}), flush=True)  # the predecessor may go now
    t["answered"] = _now()
    engine = _engine(model, [2, 3])
    t["engine"] = _now()
    opt = engine.optimizer
    flat = opt.single_partition_of_fp32_groups[0]
    assert flat.numel() == head["master"].numel(), (flat.numel(), head["master"].numel())
    flat.data.copy_(head["master"])
    for i, f in enumerate(opt.single_partition_of_fp32_groups):  # materialise: Adam's state is lazy
        z = opt.optimizer.state[f]
        z["exp_avg"], z["exp_avg_sq"] = torch.zeros_like(f), torch.zeros_like(f)
        z["step"] = torch.tensor(go["step"] if i == 0 else 0.0)
    opt.optimizer.state[flat]["exp_avg"].copy_(head["exp_avg"])
    opt.optimizer.state[flat]["exp_avg_sq"].copy_(head["exp_avg_sq"])
    del head
    torch.cuda.synchronize()
    t["injected"] = _now()
    sums = {k: _fingerprint(v) for k, v in _head_state(engine)[0].items()}
    weights = {n: _fingerprint(p.data) for n, p in list(engine.module.named_parameters())[:3]}
    losses, steps = [], []
    for s in range(args.steps):
        a = _now()
        losses.append(_step(engine, 100 + s))
        torch.cuda.synchronize()
        steps.append(round(_now() - a, 4))
    t["first_step"] = t["injected"] + steps[0]
    print(json.dumps({"from_go_read": {k: round(v - t["go_read"], 4) for k, v in t.items()},
                      "n_tensors": len(recs), "steps_s": steps, "losses": losses, "sums": sums, "weights": weights,
                      "overlap_used_GB": round((torch.cuda.mem_get_info()[1] - overlap_free) / 2**30, 2),
                      "peak_allocated_GB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="pred", choices=["pred", "succ"])
    ap.add_argument("--shape", default="1.1b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if a.role == "pred":
        os.environ.setdefault("MASTER_PORT", "29511")
        predecessor(a)
    else:
        os.environ["MASTER_PORT"] = "29512"
        successor(a)
