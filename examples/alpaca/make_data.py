"""Writes the Alpaca example's training file: a few hundred instruction records made from
templates (arithmetic, reversing words, the capitals of made-up countries, capital letters), small
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


def records(n: int, seed: int = 0) -> list[dict]:
    """``n`` Alpaca records, ``{"instruction", "input", "output"}``, cycling through the tasks."""
    rnd = random.Random(seed)
    out = [{"instruction": f"What is the capital of {c}?", "input": "", "output": f"The capital of {c} is {k}."}
           for c, k in zip(COUNTRIES, CAPITALS)]
    while len(out) < n:
        task = len(out) % 3
        if task == 0:
            a, b = rnd.randint(0, 20), rnd.randint(0, 20)
            out.append({"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)})
        elif task == 1:
            words = rnd.sample(WORDS, rnd.randint(2, 4))
            out.append({"instruction": "Reverse the order of the words.", "input": " ".join(words),
                        "output": " ".join(reversed(words))})
        else:
            words = rnd.sample(WORDS, rnd.randint(1, 3))
            out.append({"instruction": "Write the words in capital letters.", "input": " ".join(words),
                        "output": " ".join(words).upper()})
    return out[:n]


def write(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    tmp.replace(path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path, default=HERE / "data" / "alpaca.jsonl")
    p.add_argument("--records", type=int, default=300)
    args = p.parse_args()
    print(write(args.out, args.records))
