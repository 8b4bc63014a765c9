"""The whole LISA job two ways on one device, one after the other: the Hugging Face Trainer with a
LISA callback as axolotl ships it (the peer), and relayer (``orchestrator run``).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/peer.py --tiny           # a few minutes of CPU
    python benchmarks/peer.py --shape 7b --model-dir /dev/shm/m7b            # CUDA: 200 steps each way

The same job both ways: one generated model (random init from the shape, no download), the same
rows in the same order (a seeded bigram language, so that the loss falls: a fixed successor for
every token 3 times in 4), batch, optimizer (AdamW, constant lr, no decay, clipping at 1.0), seed,
2 body layers every ``--interval`` steps and ``--steps`` steps. The peer runs first
(``_peer_trainer.py``); the layers it trained, step by step (read from ``requires_grad``), become
relayer's phases, so both train the same layers on the same steps (axolotl's callback also
switches at step 1, which relayer then does too).

For each way: the whole job's wall time, from the command to the trained model on disk (the
peer's ``save_model``, relayer's RUN_DIR/final), its parts, the steady step (each phase's first
step left out), the loss of every step, device memory over time (NVML every 20 ms; the RSS of the
processes without a GPU) and per phase (torch: at its start and its peak), and whether the body's
optimizer state was reset at a switch, checked where a layer comes back: relayer's from each
phase-end manifest's ``body_step`` (the body group's Adam step, read by the worker from its
optimizer), the peer's from the optimizer's own state of the layer when it comes back and when
its phase ends. Writes results.json, table.md and peer.png into <--results-dir>/<--out>/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _peer_report import alone, plot, summarise, table
from _shapes import LAYERS_PER_PHASE, SHAPES, chosen_shape, refuse_two_shapes, shape_arguments
from _switch_watch import DeviceTrace, Devices, ManifestWatch, TreeMemory, finish_all, read_jsonl, start_all
from switch import (
    BASELINES, RESULTS, BenchmarkError, child_env, cuda_available, hardware, model_problem, nvml, relayer_command,
    relayer_source, run_logged, versions, write_atomic, write_schedule,
)

PEER = Path(__file__).resolve().parent / "_peer_trainer.py"
ON_CUDA = "7b"
"""The shape without --shape or --tiny on CUDA."""
FOLLOW = 0.75
"""How often a token is followed by its fixed successor in the generated rows (else a random token)."""


def write_bigram_rows(path: Path, rows: int, seq_len: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    successor = list(range(vocab))
    rng.shuffle(successor)
    with open(path, "w") as f:
        for _ in range(rows):
            ids = [rng.randrange(vocab)]
            while len(ids) < seq_len:
                ids.append(successor[ids[-1]] if rng.random() < FOLLOW else rng.randrange(vocab))
            f.write(json.dumps({"input_ids": ids}) + "\n")


def make_setup(args: argparse.Namespace, shape: dict, work: Path, outputs: Path, cuda: bool) -> dict:
    return {
        "seed": args.seed, "model_config": shape["model"], "model_dir": str(args.model_dir or work / "model"),
        "data_path": str(work / "train.jsonl"), "setup_path": str(work / "setup.json"),
        "peer_dir": str(work / "peer"), "peer_model": str(outputs / "peer-model"), "relayer_dir": str(outputs / "relayer"),
        "dtype": "bfloat16" if cuda else "float32", "zero_stage": args.zero_stage, "nproc": 1, "seq_len": shape["seq_len"],
        "batch_size": shape["batch_size"], "micro_batch_size": args.micro_batch or shape["micro_batch_size"],
        "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
        "total_steps": args.steps, "interval": args.interval, "layers_per_phase": LAYERS_PER_PHASE,
        "callback": args.callback, "final_model": True, "shuffle": False,
        "prewarm": None, "prewarm_depth": args.prewarm_depth, "pause_preparing_seconds": None, "handover": args.handover,
        "keep_last": args.keep_last, "every_seconds": args.every_seconds,
        "device_memory": args.device_memory, "gradient_checkpointing": args.gradient_checkpointing,
        "offload_optimizer": args.offload_optimizer,
    }


def prepare(setup: dict, shape: dict, work: Path, timeout: float, cuda: bool) -> None:
    write_atomic(Path(setup["setup_path"]), json.dumps(setup, indent=1))
    write_bigram_rows(Path(setup["data_path"]), setup["batch_size"] * setup["total_steps"], shape["seq_len"],
                      shape["model"]["vocab_size"], setup["seed"])
    if (Path(setup["model_dir"]) / "config.json").exists():
        problem = model_problem(Path(setup["model_dir"]), setup)
        if problem:
            raise BenchmarkError(f"--model-dir {problem}")
        print(f"[peer] reusing the model in {setup['model_dir']}", flush=True)
        return
    t0 = time.time()
    run_logged([sys.executable, str(BASELINES), "make-model", setup["setup_path"]], work / "make-model.log",
               "make-model", timeout, child_env(cuda))
    print(f"[peer] model made in {time.time() - t0:.1f} s", flush=True)


def traced(devices: Devices | None, run_dir: Path | None, argv: list[str], log: Path, what: str, timeout: float,
           cuda: bool) -> tuple[float, list, dict]:
    """Runs one way to its end with memory traced (and relayer's manifests read as they come)."""
    trace = DeviceTrace(devices) if devices else TreeMemory()
    watchers = [trace] + ([ManifestWatch(run_dir)] if run_dir else [])
    start_all(watchers)
    try:
        wall, _ = run_logged(argv, log, what, timeout, child_env(cuda))
    except BenchmarkError as e:  # what was traced until it failed or ran out of time stays with the error
        e.partial = {"trace": trace.trace, "manifests": watchers[1].manifests if run_dir else {}}
        raise
    finally:
        finish_all(watchers)
    return wall, trace.trace, watchers[1].manifests if run_dir else {}


def run_peer(setup: dict, devices: Devices | None, timeout: float, cuda: bool) -> dict:
    d = Path(setup["peer_dir"])
    d.mkdir(parents=True)
    t0 = time.time()
    try:
        wall, trace, _ = traced(devices, None, [sys.executable, str(PEER), setup["setup_path"]], d / "trainer.log",
                                "the peer (HF Trainer)", timeout, cuda)
    except BenchmarkError as e:
        if not setup.get("device_memory"):
            raise
        # Under a budget the peer may not fit (out of memory): said, and relayer runs LISA's layers alone.
        print(f"[peer] the peer did not finish: {e}", flush=True)
        return {"finished": False, "error": str(e), "wall_seconds": time.time() - t0, "t_command": t0, "trace": [],
                "phases": lisa_phases(setup)}
    records = json.loads((d / "records.json").read_text())
    model_bytes = sum(f.stat().st_size for f in Path(setup["peer_model"]).rglob("*") if f.is_file())
    shutil.rmtree(setup["peer_model"], ignore_errors=True)  # the disk holds one trained model at a time
    return {"wall_seconds": wall, "t_command": t0, "trace": trace, "model_bytes": model_bytes, **records}


def lisa_phases(setup: dict) -> list[dict]:
    """LISA's phases drawn here (seeded) where the peer did not finish to say which layers it trained."""
    rng, layers = random.Random(setup["seed"]), setup["model_config"]["num_hidden_layers"]
    steps, out = setup["total_steps"], []
    for start in range(0, steps, setup["interval"]):
        out.append({"steps": min(setup["interval"], steps - start),
                    "layers": sorted(rng.sample(range(layers), setup["layers_per_phase"]))})
    return out


def relayer_phases(peer: dict) -> list[dict]:
    """The peer's phases (runs of steps that trained the same layers) as relayer's schedule."""
    return [{"steps": p["steps"], "layers": p["layers"]} for p in peer["phases"]]


def run_relayer(setup: dict, devices: Devices | None, timeout: float, cuda: bool, partial: bool = False) -> dict:
    """relayer's whole run, traced; ``partial``: one that fails or runs out of time is returned as
    far as it got (``finished`` false) instead of raising."""
    d = Path(setup["relayer_dir"])
    d.mkdir(parents=True)
    sched = d / "schedule.toml"
    write_schedule(sched, setup)
    run = d / "run"
    t0 = time.time()
    try:
        wall, trace, manifests = traced(devices, run, relayer_command() + ["run", str(sched)], d / "orchestrator.log",
                                        "relayer", timeout, cuda)
    except BenchmarkError as e:
        if not partial:
            raise
        # Failed or out of time: its trace, journal and steps so far, said as such (issue #42's 7B at 24 GiB).
        print(f"[peer] relayer did not finish: {e}", flush=True)
        return {**relayer_record(setup, run, time.time() - t0, t0, **e.partial), "finished": False, "error": str(e)}
    return {**relayer_record(setup, run, wall, t0, trace, manifests), "finished": True}


def relayer_record(setup: dict, run: Path, wall: float, t0: float, trace: list, manifests: dict) -> dict:
    """relayer's way as its run directory tells it: the phases done (each with its records), the steps."""
    journal = read_jsonl(run / "journal.jsonl")
    records = {e["phase"]: e["records"] for e in journal if e["event"] == "phase_done"}
    phases = [{"phase": k, "layers": p["layers"], "steps": p["steps"], **records[k]}
              for k, p in enumerate(setup["phases"]) if k in records]
    final = run / "final"
    model_bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    steps = read_jsonl(run / "metrics.jsonl")
    return {"wall_seconds": wall, "t_command": t0, "trace": trace, "phases": phases, "journal": journal,
            "steps": steps, "manifests": manifests, "model_bytes": model_bytes,
            "final_written": any(e["event"] == "final_model_written" for e in journal)}


KEPT = ("orchestrator.log", "run/journal.jsonl", "run/metrics.jsonl", "run/phases/*/records.json",
        "run/phases/*/worker.log", "run/phases/*/*profile*.txt")
"""relayer's files kept (small: no checkpoint, no model), finished or not."""


def keep_logs(relayer: Path, peer: Path, into: Path) -> None:
    """relayer's logs, journal, steps and each phase's records and profiles, and the peer's log,
    copied into ``into`` before the scratch folder goes."""
    for pattern in KEPT:
        for f in relayer.glob(pattern):
            target = into / "relayer" / f.relative_to(relayer)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    if (peer / "trainer.log").exists():
        into.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(peer / "trainer.log", into / "peer-trainer.log")


def new_result(name: str, date: dt.datetime, cuda: bool, hw: dict, shape_name: str, shape: dict, setup: dict) -> dict:
    return {"name": name, "date": date.isoformat(timespec="seconds"), "device": "cuda" if cuda else "cpu",
            "hardware": hw, "versions": {**versions(), "relayer": relayer_source()}, "command": sys.argv,
            "load_average": {"start": os.getloadavg()},
            "storage": {"model": setup["model_dir"], "outputs": str(Path(setup["relayer_dir"]).parent)},
            "shape": {"name": shape_name, "model": shape["model"], "layer_order": "lisa (the peer's callback)",
                      **{k: setup[k] for k in ("dtype", "seq_len", "batch_size", "micro_batch_size", "lr", "total_steps",
                                               "interval", "layers_per_phase", "seed", "zero_stage")}}, "ways": {}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_arguments(ap, ON_CUDA, " (and its short job)")
    ap.add_argument("--steps", type=int, help="optimizer steps of the job (default: 200; tiny 8)")
    ap.add_argument("--interval", type=int, help="steps between LISA's switches (default: 20; tiny 2)")
    ap.add_argument("--callback", choices=("auto", "axolotl", "same-algorithm"), default="auto",
                    help="the peer's LISA callback: axolotl's where installed (auto), or one written to its algorithm")
    ap.add_argument("--model-dir", type=Path, help="the generated model: reused where it is there, else made there")
    ap.add_argument("--outputs", type=Path, help="where the trained models and relayer's run go (default: --work)")
    ap.add_argument("--micro-batch", type=int, help="examples a forward pass takes (default: the shape's)")
    ap.add_argument("--handover", choices=("auto", "on", "off", "host"), help="relayer's [launch] handover (default: relayer's)")
    ap.add_argument("--device-memory", help="a device budget such as 24GiB: relayer's launch.device_memory, and the "
                    "peer's torch.cuda.set_per_process_memory_fraction of the same bytes (issue #42)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="both ways: model.gradient_checkpointing, "
                    "the Trainer's gradient_checkpointing")
    ap.add_argument("--offload-optimizer", action="store_true", help="relayer's optimizer state on the host "
                    "(deepspeed.config.zero_optimization.offload_optimizer; with --zero-stage 1 or 2)")
    ap.add_argument("--prewarm-depth", type=int, help="relayer's [launch] prewarm_depth (default: relayer's)")
    ap.add_argument("--keep-last", type=int, help="relayer's [checkpoint] keep_last (default: 2)")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                    help="relayer's deepspeed.zero_stage (0: its own AdamW over fp32 masters, no ZeRO; default: "
                         "relayer's, 0 on one process)")
    ap.add_argument("--every-seconds", type=float,
                    help="relayer's [checkpoint] every_seconds (default: relayer's; 0: a checkpoint at every phase end)")
    ap.add_argument("--skip-peer", action="store_true", help="relayer alone, on LISA's phases drawn here: the "
                    "results say the peer was not run (issue #42: its 7B run at 24 GiB needs the whole command)")
    ap.add_argument("--out", help="the results folder's name (default: DATE-DEVICE-SHAPE-peer)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds either way may run")
    ap.add_argument("--deadline", type=float, help="a time (seconds since the epoch) relayer's run ends by, "
                    "finished or not (a device command's limit)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    refuse_two_shapes(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.time()
    nv = nvml()
    cuda = cuda_available(nv)
    devices = Devices(nv, 1) if cuda and nv else None
    name = chosen_shape(args, cuda, ON_CUDA)
    shape = SHAPES[name]
    args.steps = args.steps or (8 if name == "tiny" else 200)
    args.interval = args.interval or (2 if name == "tiny" else 20)
    hw, date = hardware(devices), dt.datetime.now().astimezone()
    slug = hw.get("gpu_nvml", "cuda").lower().replace(" ", "-") if cuda else "cpu"
    out = args.results_dir / (args.out or f"{date:%Y-%m-%d}-{slug}-{name}-peer")
    work = args.work or Path(tempfile.mkdtemp(prefix="relayer-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    outputs = args.outputs or work
    setup = make_setup(args, shape, work, outputs, cuda)
    result = new_result(out.name, date, cuda, hw, name, shape, setup)
    try:
        prepare(setup, shape, work, args.timeout, cuda)
        out.mkdir(parents=True, exist_ok=True)
        if args.skip_peer:
            result["peer"] = "not run (--skip-peer): relayer alone, on LISA's phases drawn here (lisa_phases)"
            setup["phases"] = result["shape"]["phases"] = lisa_phases(setup)
        else:
            print("[peer] the peer (HF Trainer + LISA callback) ...", flush=True)
            result["ways"]["peer"] = run_peer(setup, devices, args.timeout, cuda)
            setup["phases"] = result["shape"]["phases"] = relayer_phases(result["ways"]["peer"])
            print(f"[peer] the peer: {result['ways']['peer']['wall_seconds']:.1f} s", flush=True)
        print(f"[peer] relayer ({len(setup['phases'])} phases) ...", flush=True)
        timeout = min(args.timeout, args.deadline - time.time()) if args.deadline else args.timeout
        result["ways"]["relayer"] = run_relayer(setup, devices, timeout, cuda,
                                                partial=args.skip_peer or bool(setup.get("device_memory")))
    except BenchmarkError as e:
        print(f"peer.py: {e}", file=sys.stderr)
        return 1
    finally:
        keep_logs(Path(setup["relayer_dir"]), Path(setup["peer_dir"]), out / "logs")
        for trained in (setup["peer_model"], setup["relayer_dir"]):  # GBs each: read, not kept
            shutil.rmtree(trained, ignore_errors=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["load_average"]["end"] = os.getloadavg()
    result["seconds_total"] = time.time() - t_start
    for way in result["ways"].values():  # NVML's used bytes of the device every 20 ms: the budget's check (#42)
        way["device_peak"] = max((u for _, u in way["trace"]), default=None)
    peer = result["ways"].get("peer", {"finished": False})
    if peer.get("finished") is False or result["ways"]["relayer"]["finished"] is False:
        result["summary"] = {"peer_finished": False if "peer" in result["ways"] else "not run",
                             "relayer": alone(result["ways"]["relayer"])}
        write_atomic(out / "results.json", json.dumps(result, indent=1))
        print(f"[peer] relayer alone: {json.dumps({k: v for k, v in result['summary']['relayer'].items() if k != 'switches'})}"
              f"; wrote {out}/results.json", flush=True)
        return 0
    result["summary"] = summarise(result)
    write_atomic(out / "results.json", json.dumps(result, indent=1))
    write_atomic(out / "table.md", table(result))
    plot(result, out / "peer.png")
    print(f"[peer] {result['seconds_total']:.0f} s in all; wrote {out}/table.md, peer.png, results.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
