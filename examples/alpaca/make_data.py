"""Writes the Alpaca example's training file: a few hundred instruction records made from
templates (the capitals of made-up countries, counting, capital letters, repeating and
reversing words), small
enough for the tiny model to learn on a CPU. Deterministic: the same file every time.

    python examples/alpaca/make_data.py [OUT.jsonl] [--records N]   # default: examples/alpaca/data/alpaca.jsonl
"""

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COUNTRIES = ["Zorbia", "Quellan", "Miravel", "Tosk", "Brindor", "Valemark", "Ostrava Nova", "Kelpin", "Arunda",
             "Fendral", "Lusk", "Pelgrin", "Sorvia", "Tamber", "Uldor", "Wexmoor", "Yarrow", "Corvath", "Dunmere",
             "Elsin"]
CAPITALS = ["Quellon", "Mistra", "Harrowgate", "Pellin", "Aldport", "Sunmere", "Riva", "Tollan", "Berin",
            "Cassow", "Drummel", "Eskar", "Fallow", "Gorran", "Hessel", "Ivry", "Jarrow", "Kestrel", "Lorne",
            "Marrin"]
WORDS = ["red", "blue", "green", "cat", "dog", "bird", "sun", "moon", "tree", "river", "stone", "cloud"]


ASK = ["What is the capital of {c}?", "Name the capital of {c}.", "Which city is the capital of {c}?",
       "Tell me the capital of {c}.", "What city is the capital of {c}?"]


def records(n: int, seed: int = 0) -> list[dict]:
    """``n`` Alpaca records, ``{"instruction", "input", "output"}``: each capital asked five ways
    (facts to memorise), then counting, capital letters, repeating and reversing words in turn."""
    rnd = random.Random(seed)
    out = [{"instruction": q.format(c=c), "input": "", "output": f"The capital of {c} is {k}."}
           for c, k in zip(COUNTRIES, CAPITALS) for q in ASK]
    while len(out) < n:
        task, w = len(out) % 4, rnd.choice(WORDS)
        if task == 0:
            i = rnd.randint(0, 49)
            out.append({"instruction": f"What number comes after {i}?", "input": "", "output": str(i + 1)})
        elif task == 1:
            out.append({"instruction": "Write the word in capital letters.", "input": w, "output": w.upper()})
        elif task == 2:
            out.append({"instruction": "Repeat the word twice.", "input": w, "output": f"{w} {w}"})
        else:
            v = rnd.choice([x for x in WORDS if x != w])
            out.append({"instruction": "Reverse the order of the words.", "input": f"{w} {v}", "output": f"{v} {w}"})
    rnd.shuffle(out)
    return out[:n]


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines at ``path``, whole or not at all: a demo takes a file that is there as made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def main(doc: str, make, default: Path, n: int) -> None:
    """The command line of the examples' data scripts, as their docstring ``doc`` shows it: ``n``
    records of ``make`` (``--records``) into ``default`` (or the file named)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path, default=default)
    p.add_argument("--records", type=int, default=n)
    args = p.parse_args()
    print(write(args.out, make(args.records)))


if __name__ == "__main__":
    main(__doc__, records, HERE / "data" / "alpaca.jsonl", 300)
