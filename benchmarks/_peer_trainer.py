"""The peer of ``peer.py``: the job as LISA users run it today, one Hugging Face ``Trainer`` with a
LISA callback (``_lisa_callback.py``) in one process, to the trained model on disk.

    python benchmarks/_peer_trainer.py SETUP.json

SETUP.json (written by ``peer.py``) names the model, the data, the optimizer, the batch, the steps
and where to write. The model is loaded as those tools load it (``from_pretrained`` in the run's
dtype: bf16 on CUDA, so the Adam moments are bf16 too; ``bf16=True``), the rows are read in file
order (``train_sampling_strategy="sequential"``; relayer reads them with ``shuffle = false``), the
optimizer is the Trainer's default over every parameter (axolotl and LMFlow build it before the
callback first freezes anything). Writes ``records.json`` beside the model: per step its layers
(read from ``requires_grad``), loss, time and device memory; per phase (a run of steps training the
same layers) its memory and the Adam state of its layers when they start and end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T_START = time.time()

import psutil  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lisa_callback import LAYERS_ATTRIBUTE, LisaArguments, lisa_callback  # noqa: E402

T_IMPORTED = time.time()


class Rows(torch.utils.data.Dataset):
    """The token rows of a ``tokens`` JSON-lines file, every token a target (as relayer reads them)."""

    def __init__(self, path: Path):
        self.rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.rows[i], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def memory() -> dict[str, int]:
    if torch.cuda.is_available():
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "max_allocated": torch.cuda.max_memory_allocated()}
    return {"rss": psutil.Process().memory_info().rss}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def adam_state(optimizer, layer: torch.nn.Module) -> dict:
    """Adam's step and the size of its first moment for ``layer``'s first weight (all of a layer's
    parameters step together): what a reset would have zeroed."""
    state = getattr(optimizer, "optimizer", optimizer).state
    p = next(layer.parameters())
    s = state.get(p)
    if not s:
        return {"adam_step": 0, "exp_avg_abs_sum": 0.0}
    return {"adam_step": int(float(s["step"])), "exp_avg_abs_sum": float(s["exp_avg"].float().abs().sum())}


def state_bytes(optimizer) -> int:
    state = getattr(optimizer, "optimizer", optimizer).state
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))


class Recorder(TrainerCallback):
    """Added after the LISA callback, so that at each step's begin it sees the layers it unfroze."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.steps: list[dict] = []
        self.phases: list[dict] = []
        self.trained: dict[int, int] = {}
        """Steps each layer has trained so far."""
        self.t0 = self.t_train_begin = 0.0

    def active(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if any(p.requires_grad for p in layer.parameters())]

    def on_train_begin(self, args, state, control, **kwargs):
        self.t_train_begin = time.time()

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        sync()
        layers = self.active()
        if not self.phases or self.phases[-1]["layers"] != layers:
            self._close(optimizer)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.phases.append({"phase": len(self.phases), "start_step": state.global_step, "layers": layers,
                                "memory_start": memory(), "t_start": time.time(),
                                "at_start": {str(i): {**adam_state(optimizer, self.layers[i]),
                                                      "trained_before": self.trained.get(i, 0)} for i in layers}})
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        dt = time.perf_counter() - self.t0
        layers = self.phases[-1]["layers"]
        for i in layers:
            self.trained[i] = self.trained.get(i, 0) + 1
        self.steps.append({"step": state.global_step, "phase": self.phases[-1]["phase"], "layers": layers,
                           "step_seconds": dt, "time": time.time(), **memory()})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.steps and logs and "loss" in logs:
            self.steps[-1].update(loss=logs["loss"], grad_norm=logs.get("grad_norm"))

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self._close(optimizer)

    def _close(self, optimizer) -> None:
        """The phase ending now: its steps, its memory peak and its layers' Adam state at its end."""
        if not self.phases or "steps" in self.phases[-1]:
            return
        ph = self.phases[-1]
        ph["steps"] = sum(1 for s in self.steps if s["phase"] == ph["phase"])
        now = memory()
        ph["memory_peak"] = now.get("max_allocated", now.get("rss"))
        ph["optimizer_state_bytes"] = state_bytes(optimizer)
        ph["at_end"] = {str(i): adam_state(optimizer, self.layers[i]) for i in ph["layers"]}


def arguments(setup: dict, cuda: bool, out: Path) -> LisaArguments:
    return LisaArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=setup["micro_batch_size"],
        gradient_accumulation_steps=setup["batch_size"] // setup["micro_batch_size"], max_steps=setup["total_steps"],
        learning_rate=setup["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=setup["weight_decay"],
        adam_beta1=setup["betas"][0], adam_beta2=setup["betas"][1], adam_epsilon=setup["eps"],
        max_grad_norm=setup["grad_clip"], bf16=cuda and setup["dtype"] == "bfloat16", use_cpu=not cuda,
        logging_steps=1, save_strategy="no", report_to="none", seed=setup["seed"], disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0,
        lisa_n_layers=setup["layers_per_phase"], lisa_step_interval=setup["interval"],
        lisa_layers_attribute=LAYERS_ATTRIBUTE, gradient_checkpointing=bool(setup.get("gradient_checkpointing")))


def main(argv: list[str]) -> int:
    setup = json.loads(Path(argv[1]).read_text())
    out = Path(setup["peer_dir"])
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    if cuda and setup.get("device_memory"):  # issue #42: the peer held to the same budget as relayer
        from shard_tools.sizes import parse_size

        budget = parse_size(setup["device_memory"])
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(0).total_memory))
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=getattr(torch, setup["dtype"]),
                                                 use_safetensors=True)
    t_loaded = time.time()
    trainer = Trainer(model=model, args=arguments(setup, cuda, out), train_dataset=Rows(Path(setup["data_path"])))
    callback, about = lisa_callback(trainer, setup["callback"])
    recorder = Recorder(model.model.layers)
    trainer.add_callback(callback)
    trainer.add_callback(recorder)  # after the LISA callback: it sees the layers each step trains
    trainer.train()
    t_trained = time.time()
    trainer.save_model(setup["peer_model"])
    t_saved = time.time()
    records = {"callback": about, "optimizer": trainer.args.optim, "steps": recorder.steps,
               "phases": recorder.phases, "cuda": cuda, "device_name": torch.cuda.get_device_name() if cuda else None,
               "times": {"t_start": T_START, "t_imported": T_IMPORTED, "t_loaded": t_loaded,
                         "t_train_begin": recorder.t_train_begin, "t_trained": t_trained, "t_saved": t_saved}}
    (out / "records.json").write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
