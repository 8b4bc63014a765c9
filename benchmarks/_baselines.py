"""The two ways relayer is compared with, and the shared model maker; ``switch.py`` runs these.

    python benchmarks/_baselines.py make-model SETUP.json            # the base HF model dir
    python benchmarks/_baselines.py inprocess SETUP.json             # (b): all phases, one process
    python benchmarks/_baselines.py naive SETUP.json PHASE           # (c): one phase, one process
    python benchmarks/_baselines.py bare OUT.json                    # a bare phase process's memory

SETUP.json is written by ``switch.py`` (model, data, batch, optimizer, phases, where to write).
Each mode needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for one process, as
relayer's "local" launcher sets them. Per phase it writes WAY_DIR/records-NNNN.json with the same
fields as relayer's phase records, and a line a step to WAY_DIR/metrics.jsonl.

(b) is what users do today: one model object, and per phase freeze all but head + layers, a fresh
AdamW, ``deepspeed.initialize``, train, ``engine.destroy()``, ``gc.collect()``,
``torch.cuda.empty_cache()`` (DeepSpeed issue #6729: the old optimizer's memory stays).
(c) is the naive restart: a fresh process per phase that loads the whole model from the previous
phase's ``save_pretrained`` output and saves the whole model at its end. Neither carries the
head's optimizer state across phases; only the timing and memory are compared.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil


def memory_peak() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    # As in launch.phase: on the CPU the "peak" is the RSS at the phase's end.
    return psutil.Process().memory_info().rss


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def make_model(setup: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(setup["model_config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(setup["seed"])
    # Random init of 1.1B parameters takes many seconds on the CPU and about one on the GPU; this
    # process exits before any way starts, so its device memory is back by then. Made in the
    # run's dtype directly: a 30B model in fp32 (130 GB) would not fit one H200, and its bf16
    # copy is what is written (safetensors, 13.5 GB at 7B, 65 GB at 30B).
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, setup["dtype"]))
    model.save_pretrained(setup["model_dir"], max_shard_size="5GB")


def bare(out: Path) -> None:
    """A phase process with nothing of its own yet: the imports, and CUDA initialised where there
    is a device. Its USS is what every phase process pays; a waiting phase's USS above it is what
    that phase holds (its model, its data, its buffers)."""
    import deepspeed  # noqa: F401
    import torch
    import transformers  # noqa: F401

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    if cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context itself, as a phase makes it
    mem = psutil.Process().memory_full_info()
    write_json(out, {"uss": mem.uss, "rss": mem.rss, "cuda": cuda})


def head_and_layers(name: str, layers: list[int]) -> bool:
    head = ("model.embed_tokens.", "lm_head.", "model.norm.")
    return name.startswith(head) or name.startswith(tuple(f"model.layers.{i}." for i in layers))


def deepspeed_config(setup: dict, trainable_numel: int) -> dict:
    """What ``launch.engine.ZeroBackend.config`` builds for the same schedule (buckets sized the same)."""
    bucket = int(min(5e8, max(5e5, trainable_numel)))
    return {
        "train_batch_size": setup["batch_size"],
        "train_micro_batch_size_per_gpu": setup["micro_batch_size"],
        "gradient_accumulation_steps": setup["batch_size"] // setup["micro_batch_size"],
        "gradient_clipping": setup["grad_clip"],
        "zero_optimization": {"stage": setup["zero_stage"], "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket},
        "bf16": {"enabled": setup["dtype"] == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class Trainer:
    """The per-process parts both baselines share: distributed init, data, one phase's steps."""

    def __init__(self, setup: dict, way_dir: Path):
        import deepspeed
        import torch
        from deepspeed.accelerator import get_accelerator

        from launch.data.examples import SampleOrder, load_examples, prepare
        from launch.contract.data import DataPart, SourcePart
        from launch.ops import load_comm_ops, unlink_comm_buffers

        self.setup, self.way_dir = setup, way_dir
        accel = get_accelerator()
        load_comm_ops()  # under relayer's lock, as every phase loads it: never a race over the JIT build
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
        unlink_comm_buffers(int(os.environ["RANK"]))  # its 69 MB in /dev/shm would outlive it
        self.cuda = accel.device_name() == "cuda"
        if self.cuda:
            torch.cuda.set_device(0)
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        data = DataPart(sources=[SourcePart(path=setup["data_path"], format="tokens")], seed=setup["seed"],
                        seq_len=setup["seq_len"], batch_size=setup["batch_size"],
                        micro_batch_size=setup["micro_batch_size"], shuffle=True)
        # relayer's own sample order, so every way sees the same rows at the same global step.
        self.examples = load_examples(prepare(data, None, way_dir))
        self.order = SampleOrder(len(self.examples), setup["seed"], True)

    def build(self, model, layers: list[int]):
        import deepspeed
        import torch

        for name, p in model.named_parameters():
            p.requires_grad_(head_and_layers(name, layers))
            p.grad = None
        trainable = [p for p in model.parameters() if p.requires_grad]
        s = self.setup
        # A client torch AdamW, as relayer passes one: DeepSpeed's "torch_adam" path, no compiled kernel.
        optimizer = torch.optim.AdamW(trainable, lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"],
                                      weight_decay=s["weight_decay"])
        config = deepspeed_config(s, sum(p.numel() for p in trainable))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine

    def train(self, engine, phase: int, start_step: int, steps: int, records: dict) -> None:
        import torch

        from launch.data.examples import micro_batch

        s = self.setup
        gas = s["batch_size"] // s["micro_batch_size"]
        times: list[float] = []
        with open(self.way_dir / "metrics.jsonl", "a") as metrics:
            for step in range(start_step, start_step + steps):
                t0 = time.perf_counter()
                loss_sum = 0.0
                for micro in range(gas):
                    batch = micro_batch(self.examples, self.order, step, s["batch_size"], micro, 0, 1,
                                        s["micro_batch_size"])
                    loss = engine(**{k: v.to(self.device) for k, v in batch.items()}).loss
                    engine.backward(loss)
                    engine.step()
                    loss_sum += loss.item()
                # The same per-step collective and sync as relayer's worker, so step times compare.
                flags = torch.tensor([loss_sum / gas, 0.0], device=self.device)
                torch.distributed.all_reduce(flags)
                if self.cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                times.append(dt)
                metrics.write(json.dumps({"time": time.time(), "step": step + 1, "phase": phase,
                                          "loss": flags[0].item(), "step_seconds": dt}) + "\n")
                metrics.flush()
                if step == start_step:
                    records["t_first_step_end"] = time.time()
        records["t_last_step_end"] = time.time()
        records["step_seconds_median"] = statistics.median(times[1:] or times)
        records["memory_peak"] = memory_peak()

    def reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(0) if self.cuda else "cpu"


def load_model(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.config.use_cache = False
    return model


def run_inprocess(setup: dict) -> None:
    import torch

    from launch.prepare import memory_now  # measured exactly as relayer's phases measure, so the ways compare

    way_dir = Path(setup["work_dir"]) / "inprocess"
    way_dir.mkdir(parents=True, exist_ok=True)
    t_process_start = psutil.Process().create_time()
    trainer = Trainer(setup, way_dir)
    model = None
    step = 0
    for k, phase in enumerate(setup["phases"]):
        trainer.reset_peak()
        records = {"phase": k, "layers": phase["layers"], "t_process_start": t_process_start,
                   "memory_start": memory_now(), "device_name": trainer.device_name()}
        if model is None:
            model = load_model(setup["model_dir"], setup["dtype"])
        engine = trainer.build(model, phase["layers"])
        records["memory_engine"] = memory_now()
        trainer.train(engine, k, step, phase["steps"], records)
        step += phase["steps"]
        engine.destroy()
        del engine
        gc.collect()
        if trainer.cuda:
            torch.cuda.empty_cache()
        records["memory_after_destroy"] = memory_now()
        write_json(way_dir / f"records-{k:04d}.json", records)
    torch.distributed.destroy_process_group()


def run_naive(setup: dict, k: int) -> None:
    import torch

    from launch.prepare import memory_now

    way_dir = Path(setup["work_dir"]) / "naive"
    way_dir.mkdir(parents=True, exist_ok=True)
    phase = setup["phases"][k]
    records = {"phase": k, "layers": phase["layers"], "t_process_start": psutil.Process().create_time()}
    trainer = Trainer(setup, way_dir)
    records["memory_start"] = memory_now()
    records["device_name"] = trainer.device_name()
    source = setup["model_dir"] if k == 0 else str(way_dir / f"model-{k - 1:04d}")
    model = load_model(source, setup["dtype"])
    engine = trainer.build(model, phase["layers"])
    records["memory_engine"] = memory_now()
    start = sum(p["steps"] for p in setup["phases"][:k])
    trainer.train(engine, k, start, phase["steps"], records)
    t0 = time.time()
    # ZeRO-1/2 update the module's own weights in place, so the module is the trained model.
    engine.module.save_pretrained(str(way_dir / f"model-{k:04d}"))
    records["save_seconds"] = time.time() - t0
    write_json(way_dir / f"records-{k:04d}.json", records)
    torch.distributed.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("make-model", "inprocess", "naive", "bare"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "bare":
        bare(Path(argv[2]))
        return 0
    setup = json.loads(Path(argv[2]).read_text())
    if argv[1] == "make-model":
        make_model(setup)
    elif argv[1] == "inprocess":
        run_inprocess(setup)
    else:
        run_naive(setup, int(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
