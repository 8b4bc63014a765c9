"""One phase inside one process group: prepare, switch (go, read the delta, build, restore), train,
save. ``Phase`` owns the state the steps share; each step lives in a module of its own:
``launch.prepare``, ``launch.switch``, ``launch.train``, ``launch.save``. See ``launch.worker``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil
import torch
from torch import nn

from launch import handover, prepare, save, switch, train
from launch.contract.files import PhaseDir
from launch.contract.spec import PhaseSpec
from launch.data import SampleOrder
from launch.staging import Staging
from launch.handover import Carried
from launch.switch import Delta
from launch.timeline import Timeline
from shard_tools.checkpoint import PreparedFiles

PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written, run again to go on


class Phase:
    """State of one phase process, all declared here; the steps set it in the order
    prepare -> await_go -> assemble -> restore -> train -> save."""

    def __init__(self, spec: PhaseSpec, rank: int, world: int, prebuilt: dict[str, nn.Module] | None = None):
        self.spec, self.rank, self.world = spec, rank, world
        self.run_dir = Path(spec.run_dir)
        self.timeline = Timeline(rank=rank, world_size=world, t_process_start=psutil.Process().create_time())
        """Every timing and measurement of this process: its records.json."""
        self.prebuilt = prebuilt if prebuilt is not None else {}
        """Base models built before this process was forked (``launch.zygote``), by ``prepare.model_key``."""
        self.restore_path: str | None = spec.restore
        """The checkpoint to restore from: the spec's, or the one the go names (pre-warmed)."""
        # -- prepare
        self.device: torch.device = torch.device("cpu")
        self.staging: Staging | None = None
        """Where this rank trains; on CUDA, pinned host buffers for fast copies to and from it."""
        self.model: nn.Module | None = None
        """The host model: base weights, every layer's newest trained ones in (or see ``refusal``)."""
        self.persistent: list[str] = []
        self.layers_attr = ""
        """The model's parts outside its layers (embeddings, final norm, LM head: the head), and
        where it keeps its layers (``model.layers``)."""
        self.head_names: list[str] = []
        self.body_names: list[str] = []
        """The parameter names of the head (trained in every phase) and of this phase's layers."""
        self.trained: dict[str, torch.Tensor] = {}
        """fp32 weights of the trainable parameters, for their fp32 masters (the module may be bf16)."""
        self.examples = self.validation = None
        self.order: SampleOrder | None = None
        """The training rows, the validation rows (with a validation path), which rows each step takes."""
        self.preloaded: dict = {}
        """Layer -> the checkpoint its host model weights (taking over: device masters) came from."""
        self.prepared: PreparedFiles | save.FilesLater | None = None
        """Rank 0's files of the next checkpoint, made ahead."""
        self.refusal: str | None = "not pre-warmed"
        """Why it will not take its predecessor's state (``launch.handover``); None: ``model`` is a skeleton."""
        # -- switch
        self.handover_from: str | None = None
        """The predecessor's phase directory, where the go says it offers its state."""
        self.delta: Delta | None = None
        """The checkpoint whose changes the host model holds, and its manifest."""
        self.carried: Carried | None = None
        """The steps and loss scale carried on: from the restored checkpoint, or the offer."""
        self.awaiting: Path | None = None
        """The predecessor's checkpoint, not yet committed at the go: this phase's own wait for it."""
        self.head_state: dict | None = None
        """The head's optimizer state, mapped from its file, until it is on the device."""
        self.populating: prepare.Background | None = None
        """Maps the head's moments (``switch.read_delta``) while the engine is built."""
        self.roles: list[int] = []
        """The role (``zero_state.HEAD_DECAY``...) of each of the optimizer's param groups."""
        self.ds_config: dict = {}
        self.gas = 1
        """The DeepSpeed config the engine was built with, and its gradient accumulation steps."""
        self.engine = None
        self.head: list[tuple[str, nn.Parameter]] = []
        self.body: list[tuple[str, nn.Parameter]] = []
        """The DeepSpeed engine, and its parameters of the head and of this phase's layers, by name."""
        # -- train
        self.step = spec.start_step
        self.tb = self.wandb = None
        """The global step (steps done so far); TensorBoard's writer and the Weights & Biases run,
        once the first metric is logged to them."""

    def stage(self, name: str) -> None:
        """What this phase is doing before its first step, for the progress display (rank 0)."""
        if self.rank == 0:
            PhaseDir(self.spec.phase_dir).append_stage(name)

    def write_records(self) -> None:
        if self.rank == 0:
            PhaseDir(self.spec.phase_dir).write_records(self.timeline.as_records())

    def discard(self) -> None:
        prepared, self.prepared = self.prepared, None
        if isinstance(prepared, save.FilesLater):
            prepared = prepared.result()
        if prepared is not None:
            prepared.discard()


def run_phase(spec: PhaseSpec, rank: int, world: int, stop: dict,
              prebuilt: dict[str, nn.Module] | None = None) -> int:
    # The process group is not destroyed: the process exits right after (launch.worker), which
    # frees it and all device memory; an orderly NCCL teardown would only delay the next phase.
    phase = Phase(spec, rank, world, prebuilt)
    try:
        prepare.prepare(phase)
        if spec.prewarm:
            switch.await_go(phase)
        with _profiled(Path(spec.phase_dir) / f"switch-profile-rank{rank}.txt"):
            switch.assemble(phase)
            switch.restore(phase)
        done = train.train(phase, stop)
        snap = handover.offer(phase) if done else None
        save.save(phase, phase_complete=done, snap=snap)
        if phase.wandb is not None:
            phase.wandb.finish()
    except BaseException:
        phase.discard()
        raise
    phase.write_records()
    return 0 if done else PREEMPTED


@contextlib.contextmanager
def _profiled(report: Path):
    """For the benchmarks (``RELAYER_PROFILE_SWITCH=1``): where the engine build and the restore
    spend their time, as cProfile sees it, written to ``report``; otherwise nothing."""
    if not os.environ.get("RELAYER_PROFILE_SWITCH"):
        yield
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(60)
        report.write_text(out.getvalue())
