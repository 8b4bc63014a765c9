"""Writes the mixed example's ShareGPT-style file: two-turn conversations about the made-up
countries of the Alpaca example (whose instructions are the other source), some opened by a
system turn. Deterministic: the same file every time.

    python examples/mixed/make_data.py [OUT.jsonl] [--records N]   # default: examples/mixed/data/sharegpt.jsonl
"""

import importlib.util
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("alpaca_data", HERE.parent / "alpaca" / "make_data.py")
alpaca = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(alpaca)


def records(n: int, seed: int = 0) -> list[dict]:
    """``n`` ShareGPT records, ``{"conversations": [{"from", "value"}, ...]}``."""
    rnd = random.Random(seed)
    capitals = list(zip(alpaca.COUNTRIES, alpaca.CAPITALS))
    out = []
    for i in range(n):
        (c, k), (d, m) = rnd.sample(capitals, 2)
        turns = [{"from": "system", "value": "Answer in one sentence."}] if i % 3 == 0 else []
        turns += [{"from": "human", "value": f"Where is the capital of {c}?"},
                  {"from": "gpt", "value": f"The capital of {c} is {k}."},
                  {"from": "human", "value": f"And {d}?"},
                  {"from": "gpt", "value": f"The capital of {d} is {m}."}]
        out.append({"conversations": turns})
    return out


if __name__ == "__main__":
    alpaca.main(__doc__, records, HERE / "data" / "sharegpt.jsonl", 60)
