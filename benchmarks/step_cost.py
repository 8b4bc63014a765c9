"""What one steady LISA step costs, way by way, in one process on one device: where relayer's step
is slower than the peer's (the HF Trainer, fused AdamW on bf16 weights; ``peer.py``).

    python benchmarks/step_cost.py --shape 7b --out DIR [--steps 20] [--profile]
    python benchmarks/step_cost.py --tiny --out /tmp/sc                  # on a CPU, to try it

Every way trains the same trainable set (the head: embeddings, lm_head, final norm; and two body
layers), on the same fixed batch, from one model made on the device:

- ``ds-zero2``: relayer's step as ``launch.prepare.build_engine`` and ``launch.train._step`` make it
  (a client torch AdamW in four groups, DeepSpeed's bf16 with fp32 masters, ZeRO-2, the step's
  loss, grad norm and flags collective);
- ``ds-zero2-fused``, ``ds-zero1-fused``, ``ds-zero0-fused``: the same with ``AdamW(fused=True)``, and
  ZeRO-1 and 0 (DeepSpeed's bf16 optimizer, fp32 masters still);
- ``ds-zero0-relayer``: relayer's ``deepspeed.zero_stage = 0``: its own AdamW over fp32 masters
  (``launch.master_adamw``, one pass of ``launch.adamw_kernel`` a parameter) under DeepSpeed's engine
  without ZeRO; ``ds-zero0-relayer-torch``: the same stepping with torch's fused AdamW instead;
- ``torch-bf16-fused``: the peer's step (bf16 weights and moments, no masters, fused AdamW,
  ``clip_grad_norm_``): less exact, and what relayer is measured against;
- ``fwd-bwd``: forward and backward alone, no optimizer (the floor every way pays).

Writes DIR/step_cost.json and DIR/step_cost.md (median and fastest step, peak memory, each way's
step against the peer's), and with ``--profile`` DIR/profile-WAY.txt (the device time of the top
operators over 3 steps). Needs RANK etc. for one process, or sets them (a port that is free).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _baselines import deepspeed_config, head_and_layers  # noqa: E402
from _shapes import LAYERS_PER_PHASE, SHAPES, chosen_shape, refuse_two_shapes, shape_arguments  # noqa: E402

WAYS = ("fwd-bwd", "torch-bf16-fused", "ds-zero2", "ds-zero2-fused", "ds-zero1-fused", "ds-zero0-fused",
        "ds-zero0-relayer-torch", "ds-zero0-relayer")
"""The last two re-point the trainable weights into their optimizer's flat block: they run after the others."""
PEER = "torch-bf16-fused"
WARM_STEPS = 3


def single_process_env() -> None:
    """RANK, WORLD_SIZE and the rest for a process group of one, where not set."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)


class Setup:
    """The model, the fixed batch and the trainable set every way shares."""

    def __init__(self, shape: dict, cuda: bool):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(shape["model"])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16
        torch.manual_seed(0)
        with self.device:
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        self.model.config.use_cache = False
        self.micro, self.gas = shape["micro_batch_size"], shape["batch_size"] // shape["micro_batch_size"]
        self.ids = torch.randint(0, config.vocab_size, (self.micro, shape["seq_len"]), device=self.device)
        self.layers = [config.num_hidden_layers // 3 + i for i in range(LAYERS_PER_PHASE)]
        self.trainable = {n for n, _ in self.model.named_parameters() if head_and_layers(n, self.layers)}
        self.head = {n for n in self.trainable if head_and_layers(n, [])}

    def freeze(self) -> list:
        for name, p in self.model.named_parameters():
            p.requires_grad_(name in self.trainable)
            p.grad = None
        return [p for p in self.model.parameters() if p.requires_grad]

    def groups(self) -> list[dict]:
        """relayer's four groups, as ``launch.groups.param_groups`` makes them (weight decay 0.01)."""
        from launch.groups import param_groups

        opt = SimpleNamespace(weight_decay=0.01)
        return param_groups(self.model, self.head, self.trainable - self.head, opt)[0]


def ds_config(setup: Setup, stage: int, numel: int) -> dict:
    """``_baselines.deepspeed_config`` (what ``launch.engine``'s backends build) for this batch."""
    return deepspeed_config({"batch_size": setup.micro * setup.gas, "micro_batch_size": setup.micro, "grad_clip": 1.0,
                             "zero_stage": stage, "dtype": "bfloat16"}, numel)


def engine_way(setup: Setup, stage: int, fused: bool, relayer: bool = False, torch_path: bool = False):
    """A DeepSpeed engine as relayer builds one, and its step as ``launch.train._step`` runs it."""
    import torch

    from launch.engine import Backend, MasterBackend, without_zero
    from launch.master_adamw import MasterAdamW

    trainable = setup.freeze()
    config = ds_config(setup, stage, sum(p.numel() for p in trainable))
    if relayer:  # accumulating as launch.engine.MasterBackend decides; the kernel where it runs, or not ("-torch")
        optimizer = MasterAdamW(setup.groups(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                grad_clip=1.0, device=setup.device, accumulate=setup.gas > 1,
                                kernel=False if torch_path else None)
        config = without_zero(config)
    else:
        optimizer = torch.optim.AdamW(setup.groups(), lr=1e-5, fused=fused or None)
    engine = (MasterBackend() if relayer else Backend()).initialize(setup.model, optimizer, config)

    def step() -> None:
        loss_sum = 0.0
        for _ in range(setup.gas):
            loss = engine(input_ids=setup.ids, labels=setup.ids).loss
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        norm = engine.get_global_grad_norm()
        flags = torch.tensor([loss_sum, 0.0, float(norm is not None and float(norm))], device=setup.device)
        torch.distributed.all_reduce(flags)
        flags[0].item()

    return step, engine.destroy


def torch_way(setup: Setup, fused: bool, optimizer_step: bool = True):
    """The peer's step (the Trainer's: backward per micro-batch, clip, fused AdamW on bf16 weights)."""
    import torch

    trainable = setup.freeze()
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=fused or None) if optimizer_step else None

    def step() -> None:
        loss_sum = 0.0
        for _ in range(setup.gas):
            loss = setup.model(input_ids=setup.ids, labels=setup.ids).loss / setup.gas
            loss.backward()
            loss_sum += loss.item()
        if optimizer is not None:
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
        for p in trainable:
            p.grad = None

    return step, lambda: None


def build(setup: Setup, way: str):
    if way == "fwd-bwd":
        return torch_way(setup, False, optimizer_step=False)
    if way == PEER:
        return torch_way(setup, True)
    stage = int(way.split("-")[1].removeprefix("zero"))
    return engine_way(setup, stage, fused=way.endswith("-fused"), relayer="-relayer" in way,
                      torch_path=way.endswith("-torch"))


def sync(setup: Setup) -> None:
    import torch

    if setup.device.type == "cuda":
        torch.cuda.synchronize()


def measure(setup: Setup, way: str, steps: int, profile: Path | None) -> dict:
    """``steps`` timed steps after ``WARM_STEPS``; the device's peak over them."""
    import torch

    step, done = build(setup, way)
    try:
        for _ in range(WARM_STEPS):
            step()
        sync(setup)
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            sync(setup)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if setup.device.type == "cuda" else 0
        if profile is not None:
            write_profile(setup, step, profile / f"profile-{way}.txt")
    finally:
        done()
        gc.collect()
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"way": way, "step_median": statistics.median(times), "step_min": min(times), "steps": len(times),
            "memory_peak": peak}


def write_profile(setup: Setup, step, path: Path) -> None:
    """The top operators by device time (CPU time without one) over 3 steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync(setup)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60) + "\n")


def table(rows: list[dict]) -> list[str]:
    peer = next((r["step_median"] for r in rows if r["way"] == PEER), None)
    out = ["| way | step median (s) | fastest (s) | against the peer's | peak allocated (GB) |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['step_median'] / peer:.3f} x" if peer else "-"
        out.append(f"| {r['way']} | {r['step_median']:.4f} | {r['step_min']:.4f} | {ratio} "
                   f"| {r['memory_peak'] / 1e9:.2f} |")
    return out


def versions() -> dict[str, str]:
    import deepspeed
    import torch
    import transformers

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "device": torch.cuda.get_device_name(0) if cuda else "cpu"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_arguments(ap, on_cuda="7b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    refuse_two_shapes(ap, args)
    if unknown := set(args.ways.split(",")) - set(WAYS):
        ap.error(f"--ways: {', '.join(sorted(unknown))} not among {', '.join(WAYS)}")
    import deepspeed
    import torch

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    name = chosen_shape(args, cuda, "7b")
    single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    if cuda:
        torch.cuda.set_device(0)
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(SHAPES[name], cuda)
    rows = [measure(setup, way, args.steps, args.out if args.profile else None) for way in args.ways.split(",")]
    shape = SHAPES[name]
    about = {"date": time.strftime("%Y-%m-%d"), "shape": name, "batch": f"{shape['batch_size']} (micro "
             f"{shape['micro_batch_size']}) x {shape['seq_len']}", "layers": setup.layers, "versions": versions(),
             "command": "python benchmarks/step_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (args.out / "step_cost.json").write_text(json.dumps({**about, "ways": rows}, indent=1) + "\n")
    lines = [f"# One steady step, way by way ({name}, batch {about['batch']}, layers {setup.layers} and the head)",
             "", f"{json.dumps(about['versions'])}; `{about['command']}`", "", *table(rows), ""]
    (args.out / "step_cost.md").write_text("\n".join(lines))
    print("\n".join(lines))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
