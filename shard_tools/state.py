"""A phase's state in one checkpoint, both ways: ``save_state`` writes a ``PhaseState`` and
``load_state`` reads it back. The files, side by side:

    head.safetensors        the head's fp32 masters and Adam moments, as "<key>/<parameter>"
    layers.safetensors      the fp32 masters of the phase's layers (its metadata: which, under what prefix);
                            at a phase end under optimizer_state "keep" also their kept Adam state,
                            as "<parameter>/<key>" (``KEPT_KEYS``): composed, kept and trimmed with them
    body_optim.safetensors  mid-phase only: those layers' Adam moments, as "<key>/<parameter>"
                            (under "keep" also each one's Adam step, "step/<parameter>")
    state.safetensors       the data position, the global step, every rank's RNG ("rng/"), the
                            fp16 loss scaler ("loss_scaler/")

and the manifest, which says what the run was made from (``Origin``). What the run's earlier
checkpoints add to one (each layer's newest weights) comes through ``layer_weights`` over
``Checkpoints.layer_sources``. Torch level.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import safetensors
import torch

from shard_tools.checkpoint import PreparedFiles, Written, file_metadata, load_tensors, map_tensors, write_checkpoint
from shard_tools.errors import CheckpointError
from shard_tools.manifest import BODY_OPTIM, HEAD, LAYERS, STATE, Manifest, layer_of, layers_said, read_manifest
from shard_tools.model import ModelSpec
from shard_tools.store import Checkpoints

OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")
MOMENTS = OPTIM_KEYS[1:]
KEPT_KEYS = (*MOMENTS, "step")
"""A layer's kept Adam state (optimizer_state "keep"): its moments, and its step (int64, one element)."""
_RNG, _SCALER = "rng/", "loss_scaler/"


@dataclass
class RunState:
    """The state file's run state, besides the global step."""

    data_position: int
    """Examples taken so far."""
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every rank's generator states, by "cpu.rank<R>" and (on CUDA) "cuda.rank<R>"."""
    scaler: dict[str, float] = field(default_factory=dict)
    """The fp16 dynamic loss scaler's fields (``launch.scaler``); empty without one, and in
    checkpoints written before the loss scale was saved."""

    def tensors(self, step: int) -> dict[str, torch.Tensor]:
        out = {"data_position": torch.tensor([self.data_position], dtype=torch.int64),
               "global_step": torch.tensor([step], dtype=torch.int64)}
        out.update({_RNG + k: t for k, t in self.rng.items()})
        out.update({_SCALER + k: torch.tensor([v], dtype=torch.float64) for k, v in self.scaler.items()})
        return out

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> RunState:
        return cls(data_position=int(tensors["data_position"].item()),
                   rng={k[len(_RNG):]: t for k, t in tensors.items() if k.startswith(_RNG)},
                   scaler={k[len(_SCALER):]: t.item() for k, t in tensors.items() if k.startswith(_SCALER)})


@dataclass
class PhaseState:
    """A phase's state at a global step, as one checkpoint holds it. Tensors are full and fp32
    (the run state's aside), on the host to be written; an offer's (``launch.handover``) are on
    the device."""

    step: int
    """The global step: steps done so far."""
    phase: int
    layers: list[int]
    phase_complete: bool
    """At a phase end (the next phase starts a fresh body); mid-phase, ``body`` holds the body's moments."""
    head_step: int
    body_step: int
    """The head's and the body's optimizer steps."""
    head: dict[str, dict[str, torch.Tensor]]
    """The head's fp32 masters and Adam moments, {``OPTIM_KEYS``: {parameter: tensor}}."""
    masters: dict[str, torch.Tensor]
    """The fp32 masters of the phase's layers, by parameter."""
    run: RunState
    body: dict[str, dict[str, torch.Tensor]] | None = None
    """Mid-phase: the phase's layers' Adam moments, {``MOMENTS``: {parameter: tensor}}; under "keep"
    also "step": each one's Adam step (``KEPT_KEYS``)."""
    lr: float | None = None
    """The learning rate of the last step taken (None where a manifest does not say)."""
    carried: list[int] = field(default_factory=list)
    """Layers whose fp32 masters ``masters`` holds besides the phase's own: trained by phases since
    the last checkpoint whose ends wrote none (``Manifest.carried_layers``)."""
    state_from: dict[str, str] | None = None
    """Per trained tensor, what its optimizer state started the phase from: "fresh", or "phase P
    step S" (kept from that checkpoint's state); the manifest's ``extra.state_from``."""
    kept: dict[str, dict[str, torch.Tensor]] | None = None
    """At a phase end under optimizer_state "keep": the phase's layers' Adam state, {``KEPT_KEYS``:
    {parameter: tensor}}, written beside their masters for the phase that trains them next."""

    @property
    def stored_layers(self) -> list[int]:
        return [*self.layers, *(l for l in self.carried if l not in self.layers)]


@dataclass(frozen=True)
class Origin:
    """What a run's checkpoints say of where they come from: enough for ``export`` to rebuild the
    base model and for ``diff`` to name the model's parts."""

    base_model: ModelSpec
    tokenizer: str | None
    persistent: list[str]
    """The model's parts outside its layers (the head)."""
    layers_attr: str
    """Where the model keeps its layers (``model.layers``)."""
    world_size: int
    zero_stage: int
    chat_template: str | None = None
    """The Jinja chat template the run trained with where it is not the tokenizer's own
    (``data.chat_template``): every export saves it beside the tokenizer (``chat_template.jinja``)."""


def save_state(run_dir: Path, state: PhaseState, origin: Origin, *, durable: bool = True,
               prepared: StateFiles | None = None, on_file_written: Callable[[str], None] | None = None) -> Written:
    """Writes ``state`` as the run's checkpoint at ``state.step`` (``write_checkpoint``: every file
    under a temporary name, checksummed, the manifest last, the folder renamed into place), into
    ``prepared``'s files where they fit; ``prepared`` is used up either way."""
    kept = {f"{name}/{key}": t for key, by_name in (state.kept or {}).items() for name, t in by_name.items()}
    files = {HEAD: flatten(state.head), LAYERS: {**state.masters, **kept}, STATE: state.run.tensors(state.step)}
    if not state.phase_complete:
        files[BODY_OPTIM] = flatten(state.body or {})
    manifest = Manifest(
        global_step=state.step, phase=state.phase, layers=list(state.layers), phase_complete=state.phase_complete,
        carried_layers=[l for l in state.carried if l not in state.layers],
        layer_sources=Checkpoints(run_dir).sources_before(state.step, state.stored_layers),
        head_step=state.head_step, body_step=state.body_step, world_size=origin.world_size,
        zero_stage=origin.zero_stage, dtype=origin.base_model.dtype, files={}, versions=versions(), created=0.0,
        extra={"data_position": state.run.data_position, "persistent": origin.persistent,
               "base_model": asdict(origin.base_model), "tokenizer": origin.tokenizer,
               "layers_attr": origin.layers_attr, "lr": state.lr,
               **({"chat_template": origin.chat_template} if origin.chat_template is not None else {}),
               **({"state_from": state.state_from} if state.state_from is not None else {})})
    files_ahead = prepared.release() if prepared is not None else None
    return write_checkpoint(run_dir, manifest, files, _metadata(state.stored_layers, origin.layers_attr), durable=durable,
                            prepared=files_ahead, on_file_written=on_file_written)


def load_state(ckpt: Path, mapped: bool = False) -> tuple[PhaseState, Manifest]:
    """The phase state ``save_state`` wrote into ``ckpt``, and its manifest. ``mapped``: the head's,
    the layers' and the body's tensors are views of the files' pages (``map_tensors``), mapped as
    they are first read (``populate_pages`` maps them ahead), not copies."""
    manifest = read_manifest(ckpt)

    def tensors(file: str) -> dict[str, torch.Tensor]:
        return map_tensors(ckpt / file, populate=False) if mapped else load_tensors(ckpt / file)

    body = None if manifest.phase_complete else _unflatten(ckpt / BODY_OPTIM, tensors(BODY_OPTIM), KEPT_KEYS)
    if body is not None and not body["step"]:
        del body["step"]  # not under "keep"
    lr = manifest.extra.get("lr")
    state = PhaseState(
        step=manifest.global_step, phase=manifest.phase, layers=manifest.layers,
        phase_complete=manifest.phase_complete, head_step=manifest.head_step, body_step=manifest.body_step,
        head=_unflatten(ckpt / HEAD, tensors(HEAD), OPTIM_KEYS), masters=_weights_only(tensors(LAYERS)),
        run=RunState.of(load_tensors(ckpt / STATE)), body=body, lr=lr if isinstance(lr, (int, float)) else None,
        carried=list(manifest.carried_layers))
    return state, manifest


def flatten(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{key: {parameter: tensor}} as a file's tensors, "<key>/<parameter>"."""
    return {f"{key}/{name}": t for key, by_name in state.items() for name, t in by_name.items()}


def _weights_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layers file's masters, without the kept Adam state beside them ("<parameter>/<key>")."""
    return {n: t for n, t in tensors.items() if "/" not in n}


def _unflatten(path: Path, tensors: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    for key, t in tensors.items():
        kind, _, name = key.partition("/")
        if kind not in out:
            raise CheckpointError(f"{path}: unexpected tensor {key!r}")
        out[kind][name] = t
    return out


def _metadata(layers: list[int], layers_attr: str) -> dict[str, dict[str, str]]:
    return {LAYERS: {"layers": ",".join(map(str, layers)), "layers_prefix": layers_attr}}


class StateFiles:
    """Rank 0's head and layers files of its next checkpoint, made ahead (``PreparedFiles``):
    ``head`` and ``masters`` are tensors over their pages, shaped as ``PhaseState``'s, for a gather
    to copy into (so on a GPU the copy from the device is the write). CheckpointError where they
    cannot be made (a full disk); used once, by ``save_state``, or discarded. ``kept``: the layers
    file also holds the layers' kept Adam state (a phase end under optimizer_state "keep"), ``kept``'s
    views {``KEPT_KEYS``: {parameter: tensor}}."""

    def __init__(self, run_dir: Path, head_shapes: dict[str, tuple[int, ...]],
                 layer_shapes: dict[str, tuple[int, ...]], layers: list[int], layers_attr: str, kept: bool = False):
        kept_specs = {f"{n}/{k}": (torch.int64, (1,)) if k == "step" else (torch.float32, s)
                      for n, s in layer_shapes.items() for k in KEPT_KEYS} if kept else {}
        layouts = {HEAD: {f"{k}/{n}": (torch.float32, s) for n, s in head_shapes.items() for k in OPTIM_KEYS},
                   LAYERS: {**{n: (torch.float32, s) for n, s in layer_shapes.items()}, **kept_specs}}
        self.files: PreparedFiles | None = PreparedFiles(run_dir, layouts, _metadata(layers, layers_attr))
        self.head = {k: {n: self.files.views[HEAD][f"{k}/{n}"] for n in head_shapes} for k in OPTIM_KEYS}
        self.masters = {n: self.files.views[LAYERS][n] for n in layer_shapes}
        self.kept = {k: {n: self.files.views[LAYERS][f"{n}/{k}"] for n in layer_shapes} for k in KEPT_KEYS} \
            if kept else {}

    def release(self) -> PreparedFiles:
        """The files, for ``write_checkpoint``; this object holds no view of them from here on."""
        files, self.files, self.head, self.masters, self.kept = self.files, None, {}, {}, {}
        return files

    def discard(self) -> None:
        if self.files is not None:
            self.release().discard()


def optim_state(ckpt: Path, mapped: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The head's {``OPTIM_KEYS``: {parameter: fp32 tensor}} of a checkpoint (``mapped``: views of
    its file's pages, mapped now, not copies)."""
    tensors = map_tensors(ckpt / HEAD) if mapped else load_tensors(ckpt / HEAD)
    return _unflatten(ckpt / HEAD, tensors, OPTIM_KEYS)


def layer_weights(sources: dict[int, Path], mapped: bool = False) -> dict[str, torch.Tensor]:
    """fp32 weights of the given layers, each from its source checkpoint's layers file.

    ``mapped``: views of the files' pages (``map_tensors``), not copies: for a reader that copies
    them on at once anyway (a phase putting them into its model: 176 MB a layer of a 1.1B model)."""
    return _weights_only(_of_layers(sources, mapped))


def kept_state(sources: dict[int, Path], mapped: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The kept Adam state (optimizer_state "keep") of the given layers, {``KEPT_KEYS``: {parameter:
    tensor}}, each from its source checkpoint's layers file, where the phase that wrote it kept it
    there: a layer whose file holds none (trained under "reset", or never) is not in it.
    ``mapped``: views of the files' pages, as ``layer_weights``'."""
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KEPT_KEYS}
    for name, t in _of_layers(sources, mapped).items():
        param, _, key = name.rpartition("/")
        if key in out:
            out[key][param] = t
    return out


def _of_layers(sources: dict[int, Path], mapped: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the given layers (their masters and any kept state), each layer's from its source."""
    by_source: dict[Path, set[int]] = {}
    for layer, src in sources.items():
        by_source.setdefault(src, set()).add(layer)
    tensors: dict[str, torch.Tensor] = {}
    for src, layers in by_source.items():
        try:
            tensors.update(_layers_of(src, layers, mapped))
        except CheckpointError:  # its file trimmed since its manifest was read (a new name): read again
            tensors.update(_layers_of(src, layers, mapped))
    return tensors


def _layers_of(src: Path, layers: set[int], mapped: bool) -> dict[str, torch.Tensor]:
    f = src / read_manifest(src).layers_name
    held, prefix = layers_said(f, file_metadata(f))
    if layers - held:
        raise CheckpointError(f"{f}: does not hold layers {sorted(layers - held)} its manifest lists")
    return {name: t for name, t in (map_tensors(f) if mapped else load_tensors(f)).items()
            if layer_of(f, name, prefix) in layers}


def run_weights(run_dir: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    """What a run's checkpoint changes over the base model: each layer's newest weights, then the head.

    All fp32. The base model itself is not included (see ``shard_tools.model.build_base_model``).
    """
    read_manifest(ckpt)
    weights = layer_weights(Checkpoints(run_dir).layer_sources(ckpt))
    weights.update(optim_state(ckpt)["master"])
    return weights


def versions() -> dict[str, str]:
    """What a checkpoint records of the software that wrote it."""
    return {"relayer": _installed("relayer"), "torch": torch.__version__, "deepspeed": _installed("deepspeed"),
            "transformers": _installed("transformers"), "safetensors": safetensors.__version__,
            "python": platform.python_version()}


def _installed(package: str) -> str:
    """An installed package's version; "source" where the packages run from a source tree that was
    not installed (PYTHONPATH), as on a machine lent for a benchmark."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "source"
