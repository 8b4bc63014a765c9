"""The peer's LISA: a Hugging Face ``TrainerCallback`` that freezes and unfreezes body layers with
``requires_grad`` inside one Trainer, over one optimizer that holds every parameter.

- ``axolotl``: axolotl's own ``lisa_callback_factory`` (``axolotl/utils/callbacks/lisa.py``,
  adapted by axolotl from LMFlow's ``DynamicLayerActivationCallback``), from an installed axolotl
  (on the lent GPU machine: its wheel in .whl/, ``benchmarks/peer-wheels.sh``, installed
  ``--no-deps``). Its package's ``__init__`` imports evaluate, wandb, trl, optimum and more,
  which the module itself never uses, so the package is stood in for by an empty one and the
  module loaded from its own file, unchanged. axolotl switches at every multiple of the interval
  and once more at step 1, from numpy's global generator (seeded by the Trainer's ``set_seed``).
- ``same-algorithm``: written for this benchmark to LMFlow's algorithm (the same freezing, at
  every multiple of the interval, ``numpy.random.choice`` without replacement): used where
  axolotl is not installed, and named so in the results.

Either way the layers a step trained are read back from ``requires_grad`` by the recorder
(``_peer_trainer.py``), not assumed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

import numpy as np
from transformers import TrainerCallback, TrainingArguments

AXOLOTL_PACKAGE = "axolotl.utils.callbacks"
LAYERS_ATTRIBUTE = "model.layers"


@dataclass
class LisaArguments(TrainingArguments):
    """The three fields axolotl's factory reads from its ``AxolotlTrainingArguments``."""

    lisa_n_layers: int = field(default=2)
    lisa_step_interval: int = field(default=20)
    lisa_layers_attribute: str = field(default=LAYERS_ATTRIBUTE)


def load_axolotl():
    """axolotl's ``lisa_callback_factory`` and a description of it, or None where axolotl is not installed."""
    try:
        utils = importlib.import_module("axolotl.utils")  # light: importlib, os, re
    except ImportError:
        return None
    folder = Path(utils.__file__).parent / "callbacks"
    if not (folder / "lisa.py").is_file():
        return None
    if AXOLOTL_PACKAGE not in sys.modules:
        stand_in = types.ModuleType(AXOLOTL_PACKAGE)
        stand_in.__path__ = [str(folder)]
        sys.modules[AXOLOTL_PACKAGE] = stand_in
    module = importlib.import_module(f"{AXOLOTL_PACKAGE}.lisa")
    try:
        version = importlib.metadata.version("axolotl")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return module.lisa_callback_factory, {"name": "axolotl", "version": version, "source": module.__file__,
                                          "how": "axolotl's lisa_callback_factory, its module loaded unchanged "
                                                 "(its package's __init__ stood in for)"}


class SameAlgorithmLISA(TrainerCallback):
    """LMFlow's ``DynamicLayerActivationCallback`` algorithm, written for this benchmark: at every
    ``interval``-th step all body layers are frozen and ``n_layers`` of them, drawn without
    replacement from numpy's global generator, unfrozen."""

    def __init__(self, trainer, n_layers: int, interval: int, layers_attribute: str = LAYERS_ATTRIBUTE):
        self.layers = reduce(getattr, layers_attribute.split("."), trainer.model)
        self.n_layers, self.interval = n_layers, interval

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.interval == 0:
            for layer in self.layers:
                layer.requires_grad_(False)
            for i in np.random.choice(range(len(self.layers)), self.n_layers, replace=False):
                self.layers[i].requires_grad_(True)


def lisa_callback(trainer, choice: str) -> tuple[TrainerCallback, dict]:
    """The callback for ``trainer`` (its args a ``LisaArguments``) and what it is: ``choice`` is
    axolotl, same-algorithm or auto (axolotl where installed)."""
    loaded = load_axolotl() if choice in ("axolotl", "auto") else None
    if loaded is not None:
        factory, about = loaded
        return factory(trainer), about
    if choice == "axolotl":
        raise SystemExit("--callback axolotl: axolotl is not installed (benchmarks/peer-wheels.sh makes its wheel)")
    a = trainer.args
    return (SameAlgorithmLISA(trainer, a.lisa_n_layers, a.lisa_step_interval, a.lisa_layers_attribute),
            {"name": "same-algorithm", "version": None, "source": __file__,
             "how": "written for this benchmark to LMFlow's DynamicLayerActivationCallback algorithm "
                    "(axolotl not installed)"})
