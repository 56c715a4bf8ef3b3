"""The checkpoint's tokenizer, its chat template, and the ids that end a response.

Prompts are encoded once into left-padded id rows (the layout the native Llama's KV-cache `generate`
wants); a response ends at any of the tokenizer's end ids (end of text, and a chat model's end of turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from graphrl.errors import GraphRLError

Tokenizer = Any  # a transformers PreTrainedTokenizerBase; kept loose so importing graphrl needs no transformers


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`transformers.AutoTokenizer` of a model folder, or the tokenizer embedded in a GGUF file."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise GraphRLError(f"a tokenizer needs transformers ({exc})", fix="pip install 'graphrl[real]'") from None
    from graphrl.models import has_tokenizer
    from graphrl.models.checkpoints import read_config, unreadable_gguf

    if path.is_dir() and not has_tokenizer(path):
        raise GraphRLError(f"checkpoint {path} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                           fix="save the tokenizer beside the weights, or `graphrl import` the model with its tokenizer")
    if path.is_dir() and (path / "config.json").is_file():  # transformers reads it too: refuse it by name first
        read_config(path / "config.json")
    try:
        if path.suffix.lower() == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:  # its message may run over lines: the first says what failed
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise GraphRLError(f"checkpoint {path} has no tokenizer that transformers can read ({reason})",
                           fix="save the tokenizer beside the weights (tokenizer.json), or run `graphrl import`") from None
    except Exception as exc:  # noqa: BLE001 - a damaged GGUF file fails anywhere inside its reader
        if path.suffix.lower() == ".gguf":
            raise unreadable_gguf(path, exc) from None
        raise


def stop_token_ids(tokenizer: Tokenizer, stop_strings: Sequence[str] = ()) -> list[int]:
    """Ids that end a response: EOS, the chat end-of-turn token if the vocabulary has one, and each stop
    string (each must be one token of this vocabulary)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
        if name in vocab:
            ids.add(vocab[name])
    for text in stop_strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise GraphRLError(f"stop string {text!r} is {len(encoded)} tokens of this tokenizer, not one",
                               fix="use stop strings that are single tokens (e.g. the chat end-of-turn marker)")
        ids.add(encoded[0])
    if not ids:
        raise GraphRLError("the tokenizer has no EOS token, so a response would never end",
                           fix="use a tokenizer with an eos_token")
    return sorted(ids)


def pad_token_id(tokenizer: Tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


def prompt_text(tokenizer: Tokenizer, prompt: str, system: str | None, chat_template: bool) -> str:
    """The text the model sees: the chat template with a generation prompt, or the prompt as is."""
    if not chat_template:
        return prompt if system is None else f"{system}\n\n{prompt}"
    if tokenizer.chat_template is None:
        raise GraphRLError("the checkpoint's tokenizer has no chat template",
                           fix="set `chat_template: false` on the dataset node, or use an instruction-tuned checkpoint")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_left_padded(tokenizer: Tokenizer, texts: Sequence[str], length: int | None = None,
                       add_special_tokens: bool = False) -> tuple[Tensor, Tensor]:
    """(ids [N, L], mask [N, L]) left-padded to `length` (default: the longest). A longer text is an error."""
    rows = [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]
    longest = max((len(r) for r in rows), default=0)
    width = longest if length is None else length
    if longest > width:
        index = max(range(len(rows)), key=lambda i: len(rows[i]))
        raise GraphRLError(f"prompt {index} is {longest} tokens, longer than prompt_len {width}",
                           fix=f"set prompt_len to at least {longest} on the dataset node")
    pad = pad_token_id(tokenizer)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[i, width - len(row):] = True
    return ids, mask


def decode_responses(tokenizer: Tokenizer, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """The text of each response, its stop token and padding left out."""
    return [tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
            for ids, mask in zip(response_ids.cpu(), response_mask.cpu().bool())]
