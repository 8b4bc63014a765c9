"""``orchestrator plan`` on random mutations of a valid schedule: keys deleted or added, values of the
wrong type, zero, negative, huge, non-finite, empty, unicode, paths to nowhere, a folder or a FIFO.

Every outcome is exit 0 or exit 2 with one message that names the schedule file (and so a key in
it) or the path at fault; never a traceback, never a hang, and nothing written. Seeded: a failure
names its seed and mutations, and reproduces with them.
"""

from __future__ import annotations

import copy
import os
import random
import tomllib
from pathlib import Path

import pytest
import tomli_w
from click.testing import CliRunner

from orchestrator.cli import main
from tests.conftest import ROOT

CASES_PER_SEED = 150
SEEDS = range(8)


def base_schedule(model: Path, data: Path) -> dict:
    """examples/tiny/schedule.toml on the test fixtures: the tiny model and token data."""
    raw = tomllib.loads((ROOT / "examples" / "tiny" / "schedule.toml").read_text())
    raw["run"]["output_dir"] = "run"
    raw["model"]["path"] = str(model)
    raw["data"].update(path=str(data), format="tokens", seq_len=16)
    return raw


def values(tmp: Path) -> list:
    return [0, -1, 1, 2**70, 10**30, -(10**30), 1.5, float("inf"), float("-inf"), float("nan"), "", "x" * 300,
            "ünï✓\u202e", True, False, [], {}, [1], [1, 2, 3], [0.9, 2.0], {"a": 1}, [{"steps": 1}],
            str(tmp / "nowhere"), str(tmp), str(tmp / "fifo"), str(tmp / "loop"), "../" * 40, "\u0000",
            "llama", "lisa", "slurm", "deepspeed", "bfloat16", "text"]


def locations(node, path=()) -> list[tuple]:
    """Every key path into the schedule, tables and lists alike."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append((*path, k))
        out.extend(locations(v, (*path, k)))
    return out


def mutate(raw: dict, rng: random.Random, tmp: Path) -> str:
    """One random change, in place; returns what it did."""
    where = rng.choice(locations(raw))
    *parents, last = where
    parent = raw
    for p in parents:
        parent = parent[p]
    kind = rng.choice(["delete", "unknown", "value", "value", "value"])
    if kind == "delete":
        if isinstance(parent, list):
            parent.pop(last)
        else:
            del parent[last]
        return f"delete {where}"
    if kind == "unknown" and isinstance(parent, dict):
        key = rng.choice(["colour", "seqlen", "Lr", "ñ", "0"])
        parent[key] = rng.choice(values(tmp))
        return f"add {(*parents, key)} = {parent[key]!r}"
    parent[last] = rng.choice(values(tmp))
    return f"set {where} = {parent[last]!r}"


@pytest.fixture
def playground(tmp_path) -> Path:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return tmp_path


@pytest.mark.parametrize("seed", SEEDS)
def test_random_mutations_of_a_schedule(seed, playground, tiny_model, tiny_data):
    rng = random.Random(seed)
    base = base_schedule(tiny_model, tiny_data)
    before = sorted(playground.rglob("*"))
    outcomes = {0: 0, 2: 0}
    for case in range(CASES_PER_SEED):
        raw = copy.deepcopy(base)
        done = [mutate(raw, rng, playground) for _ in range(rng.randint(1, 3))]
        sched = playground / "schedule.toml"
        try:
            sched.write_text(tomli_w.dumps(raw))
        except (ValueError, TypeError):
            continue  # not expressible in TOML (a NUL in a key, a list of mixed tables)
        r = CliRunner().invoke(main, ["plan", str(sched)])
        what = f"seed {seed} case {case}: {done}\n{r.output}"
        assert isinstance(r.exception, SystemExit) or r.exception is None, (what, r.exception)
        assert r.exit_code in (0, 2), what
        assert "Traceback" not in r.output, what
        if r.exit_code == 2:
            assert r.stderr.startswith("orchestrator: ") and r.stderr.endswith("\n"), what
            assert str(sched) in r.stderr or str(playground) in r.stderr or str(tiny_data) in r.stderr, what
        outcomes[r.exit_code] += 1
        sched.unlink()
        assert not (playground / "run").exists(), what
        assert sorted(playground.rglob("*")) == before, what
    assert outcomes[2] > 0


# -- chat templates, data records and run-directory entries (#26) -------------------------------
TEMPLATE_PIECES = ["{{ messages[0].content }}", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                   "{% for i in range(100000) %}", "{% endfor %}", "{{ 'x' * 100000000 }}", "{{ 9 ** 99999999 }}",
                   "{{ raise_exception('no') }}", "{{ m.nope.deeper }}", "{{ ''.__class__.__mro__ }}",
                   "{% if add_generation_prompt %}assistant:{% endif %}", "{{ eos_token }}", "{{ messages | tojson }}",
                   "{% generation %}{{ messages[-1].content }}{% endgeneration %}", "{{ 'a' | center(99999999) }}",
                   "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{", "{% for %}", "}}", "\u202e", "\x00"]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("seed", range(3))
def test_random_chat_templates_render_or_fail_in_one_line_within_budget(seed, monkeypatch):
    """Random compositions of template pieces, rendered as the data step does: a string, or one
    TemplateFault line naming the key, within the budget; never another exception, never a hang."""
    import time

    from launch.data import template
    from launch.data.template import Renderer, TemplateFault

    monkeypatch.setattr(template, "SECONDS", 0.3)
    Renderer("", {}, "data.chat_template")  # transformers imported before the clock runs
    rng = random.Random(seed)
    for case in range(40):
        source = "".join(rng.choice(TEMPLATE_PIECES) for _ in range(rng.randint(1, 6)))
        t0 = time.monotonic()
        try:
            out = Renderer(source, {"eos_token": "</s>"}, "data.chat_template").render(CHAT, rng.random() < 0.5)
            assert isinstance(out, str) and len(out) <= template.CHARS + 8 * 7, (seed, case, source)
        except TemplateFault as e:
            assert str(e).startswith("data.chat_template: ") and "\n" not in str(e), (seed, case, source, e)
        assert time.monotonic() - t0 < 5, (seed, case, source)


def random_value(rng: random.Random):
    return rng.choice([0, 1, 95, 96, -1, -100, 2**31 - 1, 2**31, 2**32 + 5, 2**63, 1.0, 1.5, float("nan"), True, None,
                       "1", [], [1], [[1]], {"a": 1}])


@pytest.mark.parametrize("seed", range(3))
def test_random_token_records_are_checked_never_narrowed(seed):
    """Every ``tokens`` record the checks pass holds ids below the vocabulary (and labels below it
    or -100), aligned: what the int32 cache keeps exactly; any other is one reason, never a raise."""
    from launch.data.records import token_fault
    from launch.data.rows import IGNORE

    rng = random.Random(seed)
    for case in range(300):
        ids = [random_value(rng) if rng.random() < 0.2 else rng.randrange(96) for _ in range(rng.randint(0, 6))]
        labels = None if rng.random() < 0.3 else [random_value(rng) if rng.random() < 0.2 else rng.choice([IGNORE, 3])
                                                   for _ in range(len(ids) + (rng.random() < 0.1))]
        fault = token_fault(rng.choice([ids, ids, random_value(rng)]) if rng.random() < 0.1 else ids, labels,
                            lambda name: name, 96)
        what = (seed, case, ids, labels, fault)
        assert isinstance(fault, str) and "\n" not in fault, what
        if not fault and isinstance(ids, list):
            assert all(type(t) is int and 0 <= t < 96 for t in ids), what
            assert labels is None or (len(labels) == len(ids)
                                      and all(type(t) is int and (0 <= t < 96 or t == IGNORE) for t in labels)), what


ENTRY_KINDS = ("link out", "dangling link", "link loop", "FIFO", "folder", "file")


def plant_entry(path: Path, kind: str, outside: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    {"link out": lambda: path.symlink_to(outside), "dangling link": lambda: path.symlink_to(outside / "gone"),
     "link loop": lambda: path.symlink_to(path), "FIFO": lambda: os.mkfifo(path), "folder": path.mkdir,
     "file": lambda: path.write_text("{}\n")}[kind]()


@pytest.mark.parametrize("seed", range(3))
def test_random_run_directory_entries_are_refused_or_read_never_followed(seed, tmp_path):
    """Random links, FIFOs, folders and files at the names a run keeps: the run's check refuses
    each in one line naming it, the readers (status's lock look, the journal, metrics, final/)
    answer without blocking, and nothing outside the run changes."""
    import signal

    from orchestrator import final
    from orchestrator.errors import RelayerError
    from orchestrator.journal import Journal
    from shard_tools.errors import InputError
    from shard_tools.history import read_journal
    from orchestrator.report import read_metrics
    from orchestrator.rundir import RUN_ENTRIES, check_entries, create_run_dir, lock_held

    rng = random.Random(seed)
    outside = tmp_path / "user"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine\n")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"seed {seed}: a read blocked"))
    for case in range(12):
        rd = tmp_path / f"run-{case}"
        create_run_dir(rd, "# schedule\n")
        Journal(rd).write("run_started", phases=1, total_steps=1)
        planted = {name: rng.choice(ENTRY_KINDS) for name in rng.sample(sorted(RUN_ENTRIES), rng.randint(1, 3))}
        for name, kind in planted.items():
            plant_entry(rd / name, kind, outside)
        signal.alarm(20)
        try:
            try:
                check_entries(rd)
                refused = None
            except RelayerError as e:
                refused = str(e)
            for read in (lambda: lock_held(rd), lambda: read_journal(rd), lambda: read_metrics(rd),
                         lambda: final.is_current(rd, 1)):
                try:
                    read()
                except (RelayerError, InputError) as e:
                    assert "\n" not in str(e) and str(rd) in str(e), (seed, case, planted, e)
        finally:
            signal.alarm(0)
        wrong = {n: k for n, k in planted.items() if k not in ({"folder"} if RUN_ENTRIES[n] == "a folder" else {"file"})}
        assert (refused is None) == (not wrong), (seed, case, planted, refused)
        assert refused is None or ("\n" not in refused and any(str(rd / n) in refused for n in wrong)), refused
        assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"] and (outside / "keep.txt").read_text() == "mine\n"
