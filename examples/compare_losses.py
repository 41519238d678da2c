"""Check that a resumed run continued another: its losses equal the source run's over the same steps.

    python examples/compare_losses.py SOURCE.json RESUMED.json

Each file holds what a trainer prints last (one JSON line: step, losses of the steps it ran). Exit 1 if they
differ by more than float rounding between engines (relative 1e-5).
"""

import json
import sys


def summary(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.loads([line for line in f if line.startswith("{")][-1])


source, resumed = summary(sys.argv[1]), summary(sys.argv[2])
first = resumed["step"] - len(resumed["losses"]) + 1
expected = source["losses"][first - 1 : resumed["step"]]
print(f"{'step':>5} {'source run':>12} {'resumed':>12}")
for step, (a, b) in enumerate(zip(expected, resumed["losses"]), first):
    print(f"{step:>5} {a:>12.6f} {b:>12.6f}")
worst = max(abs(a - b) / abs(a) for a, b in zip(expected, resumed["losses"]))
ok = len(expected) == len(resumed["losses"]) and worst <= 1e-5
print(f"{'OK' if ok else 'DIFFERENT'}: largest relative difference {worst:.1e}")
sys.exit(0 if ok else 1)
