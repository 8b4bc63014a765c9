"""Random token rows for the GPU examples (no downloads): python examples/gpu/make_tokens.py OUT N SEQ VOCAB"""

import json
import random
import sys

out, n, seq, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
with open(out, "w") as f:
    for _ in range(n):
        start = rng.randrange(vocab)
        f.write(json.dumps({"input_ids": [(start + 7 * i + rng.randrange(3)) % vocab for i in range(seq)]}) + "\n")
