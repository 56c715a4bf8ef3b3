"""Small multi-turn games on the digit tasks' vocabulary, and the text form of its tokens.

The digit tasks (`graphrl.tasks`) speak in token ids; a text environment speaks in strings. `digit_text` and
`digit_ids` convert between them (digits as `0`..`9`, the special tokens as `<bos>`, `<sep>`, `<eos>`, `<pad>`,
words separated by spaces), so a tiny digit policy can play an environment like a chat model does.
`DigitEcho` is such a game: a few turns of echoing digits, each turn's target the last one rotated.
"""

from __future__ import annotations

from graphrl.tasks import BOS, EOS, PAD, SEP

DIGIT_WORDS: dict[int, str] = {BOS: "<bos>", SEP: "<sep>", EOS: "<eos>", PAD: "<pad>"}
"""The words of the digit vocabulary's special tokens (a digit's word is the digit)."""
_IDS: dict[str, int] = {**{str(d): d for d in range(10)}, **{word: i for i, word in DIGIT_WORDS.items()}}


def digit_text(ids: list[int]) -> str:
    """Token ids of the digit vocabulary as space-separated words; ValueError on an id without a word."""
    words = []
    for i in ids:
        if 0 <= i <= 9:
            words.append(str(i))
        elif i in DIGIT_WORDS:
            words.append(DIGIT_WORDS[i])
        else:
            raise ValueError(f"token id {i} has no word in the digit vocabulary (digits 0-9 and {DIGIT_WORDS})")
    return " ".join(words)


def digit_ids(text: str) -> list[int]:
    """Space-separated words of the digit vocabulary as token ids; ValueError on an unknown word."""
    ids = []
    for word in text.split():
        if word not in _IDS:
            raise ValueError(f"{word!r} is not a word of the digit vocabulary (0-9, {', '.join(DIGIT_WORDS.values())})")
        ids.append(_IDS[word])
    return ids


class DigitEcho:
    """Echo the prompt's digits for `turns` turns; after each turn the target rotates left by one digit.

    The first target is the digits of the row's prompt (kept as the dataset wrote it, `<bos> 3 5 1 2 <sep>`);
    each next one comes as the observation `<bos> 5 1 2 3 <sep>`. A turn's reward is the fraction of target
    positions its digits (its words that are digits, in order) get right, divided by `turns`, so a perfect
    episode sums to 1; a missing digit counts wrong and extra digits earn nothing (as the digit tasks' reward).
    There are no tool calls.
    """

    seconds_per_call = 0.00001
    observation_tokens = 6  # <bos>, four digits, <sep>

    def __init__(self, turns: int = 2) -> None:
        if turns < 1:
            raise ValueError(f"digit-echo option turns={turns!r} must be at least 1")
        self.turns = int(turns)
        self._target: list[int] = []
        self._turn = 0
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, row: dict) -> None:
        self._target = [i for i in digit_ids(row["prompt"]) if i <= 9]
        if not self._target:
            raise ValueError(f"digit-echo prompt {row['prompt']!r:.80} has no digits to echo")
        self._turn = 0

    def step(self, text: str) -> tuple[str | None, float, bool]:
        got = [_IDS[word] for word in text.split() if _IDS.get(word, BOS) <= 9]
        right = sum(g == t for g, t in zip(got, self._target))
        reward = right / len(self._target) / self.turns
        self._turn += 1
        if self._turn >= self.turns:
            return None, reward, True
        self._target = self._target[1:] + self._target[:1]
        return digit_text([BOS, *self._target, SEP]), reward, False


__all__ = ["DIGIT_WORDS", "DigitEcho", "digit_ids", "digit_text"]
