"""Held-out accuracy of a model folder on examples/data/arith_test.jsonl (greedy, numeric-answer rule).

    python examples/arith/eval_arith.py examples/data/smollm2-135m                      # before training
    python examples/arith/eval_arith.py runs/grpo_smollm2_arith/checkpoints/step_000019/policy_hf   # after
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from graphrl.datasets import read_examples
from graphrl.executors.models.sampling import generate
from graphrl.models import from_pretrained
from graphrl.models.tokenizer import decode_responses, encode_left_padded, pad_token_id, prompt_text, stop_token_ids
from graphrl.rewards import numeric_answer
from graphrl.schemas.job import PromptFields

HERE = Path(__file__).parent.parent  # examples/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="A model folder with its tokenizer.")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "arith_test.jsonl")
    parser.add_argument("--limit", type=int, default=64, help="Problems evaluated.")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = from_pretrained(args.model)
    examples = read_examples(args.data, PromptFields())[: args.limit]
    texts = [prompt_text(tokenizer, ex.prompt, ex.system, chat_template=True) for ex in examples]
    ids, mask = encode_left_padded(tokenizer, texts)
    out = generate(model, ids, mask, args.max_new_tokens, temperature=0.0, eos_id=stop_token_ids(tokenizer),
                   pad_id=pad_token_id(tokenizer))
    responses = decode_responses(tokenizer, out.response_ids, out.response_mask)
    scores = [numeric_answer(r, ex.answer) for r, ex in zip(responses, examples)]
    print(json.dumps({"model": str(args.model), "problems": len(scores), "accuracy": sum(scores) / len(scores)}))


if __name__ == "__main__":
    main()
