"""RUN_DIR's and each phase directory's files that the orchestrator and the phase processes both
use, with their one writer and one reader."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from shard_tools.files import SMALL_FILE, open_append, read_regular, write_atomic, write_new

DATA_CACHE = "data-cache"
"""RUN_DIR/data-cache: the prepared data, made by the orchestrator's data step (or the first phase
process that finds it missing) and read by every phase process."""
PHASES = "phases"
RANK = "rank-"
"""How the pid, exit and error files of a rank start (``rank-N``); a launcher's is ``launcher``, an agent's ``agent-N``."""
UNRECORDED = 70
"""The fork server's exit code where it could not record a forked rank's end (``exit/``; its
disk full): it ends, and every rank it forked with it, rather than leave an end nobody sees."""
DUMP_STACKS = signal.SIGUSR2
"""On it, every phase process appends all its threads' Python stacks to ``PhaseDir.stacks``/rank-N.txt."""
WANDB_TMP = "relayer-wandb-"
"""TMPDIR/relayer-wandb-<pid>.*: a phase's W&B temporaries (``launch.report_wandb``), removed at its
finish, and by the orchestrator's next data step where the phase was killed."""


BLOB = ".bin"
"""How a rank's offered bytes (the host transport of the handover) end: ``handover/rank-N.bin``."""
SHM = Path("/dev/shm")
"""Where the host path's offered bytes lie (``HandoverPart.shm_offer``): memory, never the disk."""
RESIDENT = "resident"
"""RUN_DIR/resident: the holder's folder (``launch.resident``), a ``PhaseDir`` of its own (spec, log,
pids, exits, errors) with its ``Resident`` record per rank."""


def rank_name(rank: int) -> str:
    return f"{RANK}{rank}"


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)


_R = TypeVar("_R", bound=_Record)


class PidRecord(_Record):
    """pids/NAME.json."""

    pid: PositiveInt
    started: float
    """When the process started, in seconds since the machine booted (``launch.contract.pids``):
    with the pid, a process that no pid reuse can impersonate, and no step of the clock moves."""
    host: str | None = None  # the node it runs on (SLURM's name for it, else the host name)
    run: int | None = None
    """The run directory's inode when recorded: a copy of the directory (``cp -a RUN RUN2``) holds
    records of the original's processes, which a run in the copy must never take for its own.
    None in records written before it."""


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

    @property
    def resident(self) -> PhaseDir:
        return PhaseDir(self.path / RESIDENT)

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
        self.stacks = self.path / "stacks"  # rank-N.txt: rank N's Python stacks, appended at each DUMP_STACKS
        self.grad_norms = self.path / "grad_norms.json"
        """Rank 0's ``GradNorms``, written (durable) before the phase offers or writes its end."""
        self.handover = self.path / "handover"
        """The phase's offers to its successor (``Offer``), their answers (``Answer``) and, for
        the host transport, the offered bytes; all 0600."""

    def clear(self) -> None:
        """Removes what an earlier attempt at the phase left, before a new one starts."""
        for blob in self.blobs():
            blob.unlink(missing_ok=True)
        for stale in (self.pids, self.errors, self.exits, self.handover):
            shutil.rmtree(stale, ignore_errors=True)
        self.records.unlink(missing_ok=True)
        self.stages.unlink(missing_ok=True)
        self.grad_norms.unlink(missing_ok=True)

    def record_pid(self, name: str, pid: int, started: float, host: str | None = None) -> None:
        """pids/NAME.json, so that the orchestrator can find the process (and reap it)."""
        self.pids.mkdir(parents=True, exist_ok=True)
        record = PidRecord(pid=pid, started=started, host=host, run=self._run_inode())
        write_atomic(self.pids / f"{name}.json", record.model_dump_json(), durable=False)

    def pid_records(self, prefix: str = "") -> list[PidRecord]:
        """The readable pid files whose names start with ``prefix``, in name order; those recorded in
        another run directory (this one is a copy) are not this run's."""
        records = (_read(PidRecord, f) for f in sorted(self.pids.glob(f"{prefix}*.json")))
        run = self._run_inode()
        return [r for r in records if r is not None and r.run in (None, run)]

    def _run_inode(self) -> int | None:
        """The inode of the run directory (RUN_DIR/phases/phase-NNNN/../..): the same from every node
        of a shared file system, another in a copy."""
        try:
            return os.stat(self.path.parent.parent).st_ino
        except OSError:
            return None

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

    def write_grad_norms(self, measured: GradNorms) -> None:
        # Durable: a resume draws later phases' layers by it (the journal may not have it yet).
        write_atomic(self.grad_norms, measured.model_dump_json())

    def read_grad_norms(self) -> GradNorms | None:
        return _read(GradNorms, self.grad_norms)

    # -- the handover (``HandoverPart``): written by the phase, its successor, the orchestrator
    def offer_path(self, rank: int) -> Path:
        return self.handover / f"offer-{rank_name(rank)}.json"

    def answer_path(self, rank: int) -> Path:
        return self.handover / f"answer-{rank_name(rank)}.json"

    def blob_path(self, rank: int) -> Path:
        """The host transport's bytes of rank N's offer."""
        return self.handover / f"{rank_name(rank)}{BLOB}"

    def shm_blob_path(self, rank: int) -> Path:
        """The host path's bytes of rank N's offer: a file in shared memory named after this phase
        folder (the phase folder's own where the system has no /dev/shm)."""
        if not SHM.is_dir():
            return self.blob_path(rank)
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return SHM / f"relayer-{digest}-{rank_name(rank)}{BLOB}"

    def blobs(self) -> list[Path]:
        """Every rank's host-transport and host-path bytes that are there (removed once the phase is gone)."""
        shm = sorted(self.shm_blob_path(0).parent.glob(self.shm_blob_path(0).name.replace(rank_name(0), f"{RANK}*")))
        return sorted({*self.handover.glob(f"{RANK}*{BLOB}"), *shm})

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

    def end_written(self) -> bool:
        """Whether this phase's end wrote its checkpoint: rank 0 writes it, unless its offer was
        answered taken and carried on (``Answer.write``); every rank is answered alike."""
        answer = self.read_answer(0)
        return answer is None or answer.end_written

    # -- the holder's record (``launch.resident``): written by the holder, read by every phase
    def resident_path(self, rank: int) -> Path:
        return self.path / f"{rank_name(rank)}.json"

    def write_resident(self, rank: int, record: Resident) -> None:
        write_atomic(self.resident_path(rank), record.model_dump_json(), mode=0o600, durable=False)

    def read_resident(self, rank: int) -> Resident | None:
        return _read(Resident, self.resident_path(rank))

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


class Carried(_Record):
    """What an offer carries on besides its tensors: what the predecessor's checkpoint (its
    manifest and state file) would tell the successor."""

    phase: int
    global_step: int
    """The step the predecessor ended at."""
    layers: list[int]
    head_step: int
    body_step: int
    """Adam's steps of the head and of the predecessor's layers."""
    scaler: dict[str, float]
    """The loss scaler's fields (``launch.scaler``); {} without one."""
    restore: str | None
    """The checkpoint the predecessor started from: the successor's wait for it where the
    predecessor's end writes none."""
    end: str
    """The checkpoint the predecessor is about to commit at its end."""
    host_layers: list[dict] = []
    """The carried layers the predecessor offers where they lie, in host memory
    (``launch.carried``: a segment's pid, fd, offset, dtype and shape per tensor)."""


class Offer(_Record):
    """handover/offer-rank-N.json: rank N's state for the successor's rank N, where it lies: its
    weights, buffers and fp32 state, named as ``launch.handover`` packs them."""

    pid: int
    device: str
    """The device's UUID; "host" for the host transport."""
    transport: Literal["cuda", "host", "shm"]
    """cuda: CUDA IPC; host: every tensor's bytes in a file of the phase folder (the CPU's test of
    the choreography); shm: the host path, the fp32 state only, in shared memory."""
    blocks: list[dict[str, Any]]
    """Per shared block, how to map it: CUDA IPC's fields (bytes in base64), or offset and size."""
    tensors: list[TensorRef]
    carried: Carried


class GradNorms(_Record):
    """grad_norms.json: what a phase measured for schedule.layer_weights = "grad_norm": each body
    layer it trained and that layer's gradient L2 norm at its last step (``launch.importance``)."""

    phase: int
    step: int
    """The global step the norms are of (the phase's last, numbered from 0)."""
    layers: list[int]
    norms: list[float]
    units: list[str] = []
    """Under module units: the units measured, the norms theirs (``layers`` then empty)."""


class Resident(_Record):
    """resident/rank-N.json: where the holder of rank N's device keeps the model's weights, one
    block every phase maps (``launch.resident``), written once they are there."""

    pid: int
    device: str
    """The device's UUID; "host" for a memfd (the CPU's test of the protocol)."""
    transport: Literal["cuda", "memfd"]
    """cuda: CUDA IPC's fields of the block; memfd: the block is /proc/PID/fd/FD, mapped shared."""
    block: dict[str, Any]
    tensors: list[TensorRef]
    """Every parameter and buffer of the model by its name (a tied one under each name)."""


class Answer(_Record):
    """handover/answer-rank-N.json: the successor's rank N has its copy (``taken``) or will read the
    checkpoint instead; the orchestrator answers "not taken" for a successor that is gone."""

    taken: bool
    by: Literal["successor", "orchestrator"]
    reason: str = ""
    write: bool = True
    """False: taken, and the successor carries what this phase trained on to its own checkpoint
    (``checkpoint.every_seconds``, ``launch.contract.cadence``): this phase's end writes none."""

    @property
    def end_written(self) -> bool:
        """Whether the offering phase's end writes its checkpoint."""
        return not self.taken or self.write


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
