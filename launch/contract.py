"""The contract between the control plane (``orchestrator/``) and the worker (``launch/``).

Torch-free: the orchestrator imports this module and nothing else of ``launch/``. It holds the
phase spec (the one JSON file through which the orchestrator tells a phase what to do; unknown keys
are errors, so drift between the two sides fails loudly), the learning rate of a step (both sides
must agree on it), the run and phase directories' files that both sides use with their readers
and writers, and the channels' framing.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from shard_tools.files import SMALL_FILE, open_append, read_regular, write_atomic, write_new


DATA_CACHE = "data-cache"
"""RUN_DIR/data-cache: the prepared data, made by the orchestrator's data step (or the first phase
process that finds it missing) and read by every phase process."""

class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelPart(_Spec):
    path: str | None
    config: dict[str, Any] | None
    dtype: Literal["float32", "bfloat16", "float16"]
    persistent: list[str] | None
    layers: str | None
    gradient_checkpointing: bool = False
    tokenizer: str | None = None
    """The tokenizer's directory (the schedule's model.tokenizer, default model.path); text,
    instruction and chat data need one."""


DATA_FORMATS = ("tokens", "text", "instruction", "chat")
FIELDS = {"tokens": ("input_ids", "labels"), "text": ("text",), "instruction": ("instruction", "input", "output"),
          "chat": ("messages", "conversations")}
"""Per format, the record fields ``data.fields`` may rename (the names here are the defaults)."""


class DataPart(_Spec):
    path: str
    """A data file (.jsonl, .json, .parquet, .csv, .arrow, .txt) or a ``datasets.save_to_disk`` folder."""
    format: Literal["tokens", "text", "instruction", "chat"]
    seq_len: int
    batch_size: int
    micro_batch_size: int
    shuffle: bool
    validation_path: str | None = None
    eval_every: int = 0
    pack: bool | None = None
    """Concatenate examples into seq_len rows; None: the format's default (``packs``)."""
    train_on_prompt: bool = False
    """instruction/chat: the prompt and the user turns carry loss too."""
    chat_template: str | None = None
    """A Jinja chat template, or the absolute path of a file holding one (``is_template_path``)."""
    fields: dict[str, str] | None = None
    """Record field names by their default names (``FIELDS``), for data that names them otherwise."""

    @property
    def packs(self) -> bool:
        """Text is a stream of documents (packed, as pretraining reads it); the other formats are
        examples, one a row by default: no example is cut in two and no row's attention spans two."""
        return self.format == "text" if self.pack is None else self.pack

    def field(self, name: str) -> str:
        return (self.fields or {}).get(name, name)


def is_template_path(value: str) -> bool:
    """``data.chat_template`` names a file unless it holds Jinja (every template has ``{``)."""
    return "{" not in value


class OptimizerPart(_Spec):
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float
    lr_kind: Literal["constant", "linear", "cosine"]
    warmup_steps: int
    total_steps: int
    """The run's last global step, for the decay schedules."""


class HandoverPart(_Spec):
    """The device handover at a phase's boundaries (``launch.handover``, ``launch.handover`` the module)."""

    offer: bool = False
    """At its end (complete) it offers its state, waits for the answer, then writes its checkpoint."""
    take: bool = False
    """Pre-warmed without a host copy of the model, it takes its predecessor's state at its go."""
    host: bool = False
    """Also without a GPU, through a file (``launch.handover = "on"``); on CUDA: CUDA IPC."""
    peak_bytes: int = 0
    """The overlap's planned peak on one device; a smaller device does not take over. 0: not planned."""


class PhaseSpec(_Spec):
    run_dir: str
    tensorboard: bool = False
    wandb: bool = False
    phase_dir: str
    """Where this phase's processes record their pids and the launcher its log."""
    seed: int
    phase: int
    start_step: int
    """The global step this process group starts at (inside the phase when resuming)."""
    phase_start_step: int
    end_step: int
    layers: list[int]
    restore: str | None
    """Checkpoint to start from; None: the base model. A pre-warmed phase learns it at its go."""
    prewarm: bool = False
    """Start early, prepare, then wait on ``go_fifo`` until the predecessor's processes are gone."""
    preload: str | None = None
    """Pre-warmed: the checkpoint whose layers are known before the go (the predecessor's start)."""
    go_fifo: str | None = None
    model: ModelPart
    data: DataPart
    optimizer: OptimizerPart
    zero_stage: Literal[1, 2, 3]
    deepspeed_config: dict[str, Any]
    every_steps: int
    launcher: Literal["local", "deepspeed", "torchrun", "slurm"]
    nproc: int
    nnodes: int
    hostfile: str | None
    master_port: int
    orchestrator_pid: int | None
    """The worker stops itself when this process is gone (it may have been SIGKILLed)."""
    orchestrator_host: str | None = None
    """Where orchestrator_pid lives: ranks on other nodes cannot watch it (their launcher does)."""
    handover: HandoverPart = HandoverPart()
    """The device handover at this phase's start (``take``) and end (``offer``)."""

    @classmethod
    def read(cls, path: str | Path) -> PhaseSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))

    def changed(self, **update: Any) -> PhaseSpec:
        """``model_copy(update=...)``, validated: model_copy takes any value unchecked and drops an
        unknown key silently, so a change the worker would refuse is caught here instead."""
        return self.model_validate(self.model_dump() | update)


def lr_at(step: int, opt) -> float:
    """``opt``: lr, lr_kind, warmup_steps, total_steps (the phase spec's optimizer part)."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.lr_kind == "constant":
        return opt.lr
    span = max(1, opt.total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    if opt.lr_kind == "linear":
        return opt.lr * (1.0 - frac)
    return opt.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


# -- the run and phase directories ------------------------------------------------------------
PHASES = "phases"
RANK = "rank-"
"""How the pid, exit and error files of a rank start (``rank-N``); a launcher's pid is ``launcher``."""


def rank_name(rank: int) -> str:
    return f"{RANK}{rank}"


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)


_R = TypeVar("_R", bound=_Record)


class PidRecord(_Record):
    """pids/NAME.json."""

    pid: PositiveInt
    create_time: float
    """The process's start time: with the pid, a process that no pid reuse can impersonate."""


class ExitRecord(_Record):
    """exit/rank-N.json."""

    rc: int
    time: float = 0.0
    """When the fork server reaped the rank."""


class RunDir:
    """RUN_DIR's files that the orchestrator and the phase processes both use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.zygote_fifo = self.path / "zygote.fifo"
        """The fork server's requests (``FORK_REQUESTS``)."""
        self.zygote_log = self.path / "zygote.log"
        self.zygote_error = self.path / "zygote.error"
        """Why the fork server failed (``write_reason``)."""
        self.metrics = self.path / "metrics.jsonl"  # a line a step, by rank 0; the orchestrator tails it

    def phase(self, index: int) -> PhaseDir:
        return PhaseDir(self.path / PHASES / f"phase-{index:04d}")

    def phase_dirs(self) -> list[PhaseDir]:
        return [PhaseDir(p) for p in sorted((self.path / PHASES).glob("phase-*"))]


class PhaseDir:
    """RUN_DIR/phases/phase-NNNN: what one phase's processes and the orchestrator leave each other.

    Every file here is written whole (renamed into place) or appended by lines, and every reader
    takes a missing or unreadable file as "not there yet": the writer may still be starting, or
    may have been killed.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.spec = self.path / "spec.json"
        """The ``PhaseSpec``, written by the orchestrator before the phase's processes start."""
        self.log = self.path / "worker.log"
        """Every process of the phase logs here (stdout and stderr)."""
        self.go = self.path / "go"
        """A pre-warmed phase's go channel (``GO``), a FIFO."""
        self.records = self.path / "records.json"
        """Rank 0's timings and measurements, written once at its end."""
        self.stages = self.path / "stages.jsonl"
        """What rank 0 is doing before its first step, one JSON object a line, for the display."""
        self.pids = self.path / "pids"
        self.exits = self.path / "exit"
        """Forked ranks' exit codes, written by the fork server that reaped them."""
        self.errors = self.path / "errors"
        self.handover = self.path / "handover"
        """The phase's offers to its successor (``Offer``), their answers (``Answer``) and, for
        the host transport, the offered bytes; all 0600."""

    def clear(self) -> None:
        """Removes what an earlier attempt at the phase left, before a new one starts."""
        for stale in (self.pids, self.errors, self.exits, self.handover):
            shutil.rmtree(stale, ignore_errors=True)
        self.records.unlink(missing_ok=True)
        self.stages.unlink(missing_ok=True)

    def record_pid(self, name: str, pid: int, create_time: float) -> None:
        """pids/NAME.json, so that the orchestrator can find the process (and reap it)."""
        self.pids.mkdir(parents=True, exist_ok=True)
        record = PidRecord(pid=pid, create_time=create_time)
        write_atomic(self.pids / f"{name}.json", record.model_dump_json(), durable=False)

    def pid_records(self, prefix: str = "") -> list[PidRecord]:
        """The readable pid files whose names start with ``prefix``, in name order."""
        records = (_read(PidRecord, f) for f in sorted(self.pids.glob(f"{prefix}*.json")))
        return [r for r in records if r is not None]

    def write_exit(self, rank: int, rc: int, at: float) -> None:
        self.exits.mkdir(parents=True, exist_ok=True)
        write_atomic(self.exits / f"{rank_name(rank)}.json", ExitRecord(rc=rc, time=at).model_dump_json(),
                     durable=False)

    def read_exit(self, rank: int) -> ExitRecord | None:
        """How a forked rank ended; None until the fork server has reaped it."""
        return _read(ExitRecord, self.exits / f"{rank_name(rank)}.json")

    def write_error(self, rank: int, error: BaseException) -> None:
        """errors/rank-N.txt: the reason a rank failed, where the orchestrator looks for it."""
        write_reason(self.errors / f"{rank_name(rank)}.txt", error)

    def error_reasons(self) -> list[str]:
        return read_reasons(sorted(self.errors.glob(f"{RANK}*.txt")))

    def write_records(self, records: dict[str, Any]) -> None:
        # Read by the orchestrator while it runs only: a power cut loses it with the phase anyway.
        write_atomic(self.records, json.dumps(records, indent=1), durable=False)

    def read_records(self) -> dict[str, Any]:
        """The records, or {} where the phase wrote none (it failed, or was killed first)."""
        try:
            records = json.loads(read_regular(self.records, SMALL_FILE))
        except (OSError, ValueError, RecursionError):
            return {}
        return records if isinstance(records, dict) else {}

    # -- the handover (``HandoverPart``): written by the phase, its successor, the orchestrator
    def offer_path(self, rank: int) -> Path:
        return self.handover / f"offer-{rank_name(rank)}.json"

    def answer_path(self, rank: int) -> Path:
        return self.handover / f"answer-{rank_name(rank)}.json"

    def blob_path(self, rank: int) -> Path:
        """The host transport's bytes of rank N's offer."""
        return self.handover / f"{rank_name(rank)}.bin"

    def write_offer(self, rank: int, offer: Offer) -> None:
        self.handover.mkdir(mode=0o700, exist_ok=True)
        write_atomic(self.offer_path(rank), offer.model_dump_json(), mode=0o600, durable=False)

    def read_offer(self, rank: int) -> Offer | None:
        return _read(Offer, self.offer_path(rank))

    def offered(self, nproc: int) -> bool:
        """Every rank has made its offer (the orchestrator's cue for the successor's go)."""
        return all(self.read_offer(r) is not None for r in range(nproc))

    def write_answer(self, rank: int, answer: Answer) -> bool:
        """Answers rank N's offer; False where it was answered already (the first answer stands)."""
        self.handover.mkdir(mode=0o700, exist_ok=True)
        return write_new(self.answer_path(rank), answer.model_dump_json(), mode=0o600)

    def read_answer(self, rank: int) -> Answer | None:
        return _read(Answer, self.answer_path(rank))

    def append_stage(self, name: str) -> None:
        with os.fdopen(open_append(self.stages), "a") as f:
            f.write(json.dumps({"time": time.time(), "stage": name}) + "\n")


class TensorRef(_Record):
    """One tensor of an offer: a view into one of its blocks (``dtype`` as in ``torch.bfloat16``,
    ``offset`` in elements)."""

    name: str
    block: int
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int


class Offer(_Record):
    """handover/offer-rank-N.json: rank N's state for the successor's rank N, where it lies: its
    weights, buffers and fp32 state, named as ``launch.handover`` packs them."""

    pid: int
    device: str
    """The device's UUID; "host" for the host transport."""
    transport: Literal["cuda", "host"]
    blocks: list[dict[str, Any]]
    """Per shared block, how to map it: CUDA IPC's fields (bytes in base64), or offset and size."""
    tensors: list[TensorRef]
    carried: dict[str, Any]
    """What a checkpoint's manifest and state file would tell the successor: the steps, the loss
    scale, the checkpoint the predecessor is about to commit."""


class Answer(_Record):
    """handover/answer-rank-N.json: the successor's rank N has its copy (``taken``) or will read the
    checkpoint instead; the orchestrator answers "not taken" for a successor that is gone."""

    taken: bool
    by: Literal["successor", "orchestrator"]
    reason: str = ""


def write_reason(path: Path, error: BaseException) -> None:
    """One line naming the error, for the orchestrator to name in the failure it reports."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, f"{type(error).__name__}: {error}\n", durable=False)


def read_reasons(paths: list[Path]) -> list[str]:
    """The distinct reasons in errors files (one per rank that failed; ranks often agree)."""
    reasons: list[str] = []
    for path in paths:
        try:
            text = read_regular(path, SMALL_FILE).decode(errors="replace").strip()
        except OSError:
            continue
        if text and text not in reasons:
            reasons.append(text)
    return reasons


def _read(kind: type[_R], path: Path) -> _R | None:
    """The record in ``path``, or None: missing, unreadable, torn, or not one."""
    try:
        return kind.model_validate_json(read_regular(path, SMALL_FILE))
    except (OSError, ValidationError):
        return None


# -- the channels -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Channel:
    """Fixed-size records on a FIFO: a JSON object padded with spaces to ``size`` bytes. ``size``
    is at most PIPE_BUF, so each write reaches one reader whole, even with many readers on one
    FIFO (the ranks of a pre-warmed phase)."""

    size: int
    keys: frozenset[str]

    def encode(self, **record: Any) -> bytes:
        if set(record) != self.keys:
            raise ValueError(f"a record of keys {sorted(record)}, expected {sorted(self.keys)}")
        data = json.dumps(record).encode()
        if len(data) > self.size:
            raise ValueError(f"a record of {len(data)} bytes does not fit the channel's {self.size}: {data[:80]!r}...")
        return data.ljust(self.size)

    def decode(self, data: bytes) -> dict[str, Any]:
        if len(data) != self.size:
            raise ValueError(f"a record of {len(data)} bytes, expected {self.size}")
        record = json.loads(data)
        if not isinstance(record, dict) or set(record) != self.keys:
            raise ValueError(f"not a record of keys {sorted(self.keys)}: {data.rstrip()[:80]!r}")
        return record

    def read(self, fd: int, idle: Callable[[], None] | None = None, interval: float = 0.005) -> dict[str, Any] | None:
        """The next record from ``fd``; None at EOF (every writer gone) before a whole one.

        With ``idle`` (``fd`` is then non-blocking) it is called every ``interval`` seconds while
        nothing is there; a record that another reader took first is waited past."""
        data = b""
        while len(data) < self.size:
            if idle is not None and not select.select([fd], [], [], interval)[0]:
                idle()
                continue
            try:
                chunk = os.read(fd, self.size - len(data))
            except BlockingIOError:  # another reader took the record that woke this one
                continue
            if not chunk:
                return None
            data += chunk
        return self.decode(data)


GO = Channel(4096, frozenset({"restore", "handover"}))
"""phase-NNNN/go: a pre-warmed phase's checkpoint to restore (or None: the base model), one record
per rank, written once its predecessor's processes are gone; or, with ``handover`` (the
predecessor's phase directory), once every rank of the predecessor has made its offer: the
checkpoint is then the one the predecessor commits after the answers."""
FORK_REQUESTS = Channel(4096, frozenset({"spec", "nproc"}))
"""RUN_DIR/zygote.fifo: fork the ranks of the phase whose spec.json is at ``spec``."""
