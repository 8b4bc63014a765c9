"""The Alpaca example end to end on CPU (12 minutes on 2 cores busy with other jobs; less idle):

    .venv/bin/python examples/alpaca/run_demo.py [--steps N]

Makes the training file and the tiny Llama with its tokenizer (once), shows the data as the run
sees it, runs the LISA schedule with the real CLI (a fresh run each time), exports the result as a
Hugging Face model and asks it an instruction from the training file. ``--steps`` shortens the
run (the tests do); the answer is then not expected to be right.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
QUESTION = {"instruction": "Write the word in capital letters.", "input": "river"}


def step(*argv: str) -> None:
    print(f"\n$ {' '.join(argv)}", flush=True)
    subprocess.run([str(BIN / argv[0]), *argv[1:]], check=True, cwd=HERE)


def ask(export: Path, record: dict) -> tuple[str, str]:
    """(the prompt, the exported model's greedy answer) for one Alpaca record, rendered with the
    chat template as training rendered it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    user = record["instruction"] + ("\n\n" + record["input"] if record["input"] else "")
    prompt = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    return prompt, tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="total steps (default: the schedule's)")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not (HERE / "data" / "alpaca.jsonl").exists():
        subprocess.run([sys.executable, str(HERE / "make_data.py")], check=True)
    if not (HERE / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_model.py")], check=True)
    schedule = "schedule.toml"
    if args.steps:
        text = (HERE / schedule).read_text()
        text = re.sub(r"(?m)^total_steps = \d+", f"total_steps = {args.steps}", text)
        text = re.sub(r"(?m)^interval = \d+", f"interval = {max(1, args.steps // 2)}", text)
        text = re.sub(r"(?m)^warmup_steps = \d+", "warmup_steps = 0", text)
        schedule = "schedule.short.toml"
        (HERE / schedule).write_text(text)
    run, export = HERE / "runs" / "alpaca", HERE / "export"
    shutil.rmtree(run, ignore_errors=True)  # the demo's own output: start it afresh each time
    step("orchestrator", "data", schedule, "--show", "1")
    step("orchestrator", "run", schedule)
    step("shard-tools", "export", str(run), "--out", str(export), "--force")
    prompt, answer = ask(export, QUESTION)
    records = [json.loads(line) for line in (HERE / "data" / "alpaca.jsonl").read_text().splitlines()]
    expected = next(r["output"] for r in records if (r["instruction"], r["input"]) == tuple(QUESTION.values()))
    print(f"\nprompt:\n{prompt}\nanswer:   {answer}\nexpected: {expected}")
    print(f"\nrun directory: {run}\nHugging Face export: {export}")


if __name__ == "__main__":
    main()
