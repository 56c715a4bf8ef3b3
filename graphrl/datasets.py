"""Prompts from files: JSON lines or parquet rows mapped to (prompt, answer, system), and the prompt
source each rank draws a step's prompts from.

Step s takes examples [s*B, (s+1)*B) of an endless stream that visits every row once per epoch, in an
order shuffled per epoch from the run seed. A step's prompts are a pure function of (seed, step), so a
resumed run continues at exactly the row it stopped at, and every rank (generator, reward) agrees on
which answer belongs to which rollout without sending text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypeVar

from graphrl.errors import DataError, GraphRLError, JobError, RunError
from graphrl.schemas.job import DatasetNode, GenerateNode, JobSpec, NodeSpec, PromptFields
from graphrl.schemas.model import ModelSpec
from graphrl.tasks import EOS, PAD, TASKS, resolve_callable

if TYPE_CHECKING:  # torch loads only where prompts are drawn, never on the compile path
    from torch import Tensor

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    system: str | None = None


def _rows(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        raise DataError(f"dataset file {path} is a directory", fix="give `file:` a .jsonl or .parquet file inside it")
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist", fix="check `file:` (relative to the job file)")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"dataset file {path} is not a readable parquet file ({exc})",
                            fix="write it again (e.g. pandas.DataFrame.to_parquet), or give a JSON-lines file") from None
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"dataset file {path} is neither JSON lines nor parquet",
                        fix=f"use a file ending in one of {', '.join(SUFFIXES)}")
    rows = []
    for line_no, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
                            fix="save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{line_no}: not a JSON object ({exc.msg})",
                            fix="write one JSON object per line") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: a row must be a JSON object", fix="write one JSON object per line")
        rows.append(row)
    return rows


def read_examples(path: str | Path, fields: PromptFields) -> list[Example]:
    """Every row of a JSON-lines or parquet file as an Example; a missing or null field names its row."""
    path = Path(path)
    rows = _rows(path)
    if not rows:
        raise DataError(f"dataset file {path} has no rows", fix="add prompts to it")
    wanted = {"prompt": fields.prompt, "answer": fields.answer} | ({"system": fields.system} if fields.system else {})
    examples = []
    for index, row in enumerate(rows):
        for role, column in wanted.items():
            if column not in row:
                raise DataError(f"dataset file {path}, row {index + 1}: no field {column!r} (the {role} field); "
                                f"the row has {', '.join(map(repr, row)) or 'no fields'}",
                                fix=f"set fields.{role} on the dataset node to the column holding the {role}")
            if row[column] is None:  # str(None) would make the answer the text "None"
                raise DataError(f"dataset file {path}, row {index + 1}: the {role} field {column!r} is null",
                                fix=f"give every row a {role}, or drop the rows without one")
        examples.append(Example(prompt=str(row[fields.prompt]), answer=str(row[fields.answer]),
                                system=str(row[fields.system]) if fields.system else None))
    return examples


def prompt_token_rows(spec: DatasetNode, tokenizer: Any, rows: list[Example]) -> list[list[int]]:
    """Each row's prompt as the model sees it (chat template, system prompt), as token ids."""
    from graphrl.models.tokenizer import prompt_text

    return [tokenizer.encode(prompt_text(tokenizer, ex.prompt, ex.system or spec.system_prompt, spec.chat_template),
                             add_special_tokens=False) for ex in rows]


def check_prompt_lengths(spec: DatasetNode, token_rows: list[list[int]]) -> None:
    """Refuse a prompt longer than `prompt_len` (unless the node truncates long prompts), naming the
    file, the row (1-based, as an editor counts) and its length."""
    if spec.long_prompts == "truncate":
        return
    too_long = [(i, len(r)) for i, r in enumerate(token_rows) if len(r) > spec.prompt_len]
    if not too_long:
        return
    index, length = too_long[0]
    longest = max(n for _, n in too_long)
    raise DataError(f"dataset file {spec.file}, row {index + 1}: the prompt is {length} tokens, longer than "
                    f"prompt_len {spec.prompt_len} ({len(too_long)} rows are; the longest has {longest})",
                    fix=f"set prompt_len to at least {longest}, or long_prompts: truncate to keep the last "
                        f"{spec.prompt_len} tokens of each")


_T = TypeVar("_T")


def _at(path: tuple[str, ...], fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)`, its error placed at the job's field `path` (where the user changes something)."""
    try:
        return fn(*args)
    except GraphRLError as exc:
        raise type(exc)(exc.message, path=path, fix=exc.fix) from None


def check_file_prompts(name: str, spec: DatasetNode, rows: list[Example], nodes: Mapping[str, NodeSpec],
                       models: Mapping[str, ModelSpec]) -> None:
    """What a rank's `prompt_source` refuses of the file dataset `name`, refused when the job loads, each at
    the field to change: the model that generates from it has a checkpoint holding a tokenizer that loads
    and ends responses, the generator's stop strings are single tokens, the prompts render (the chat
    template) and fit `prompt_len`."""
    from graphrl.models import has_tokenizer
    from graphrl.models.tokenizer import load_tokenizer, stop_token_ids

    gen_name = next((n for n, node in nodes.items() if node.op == "generate"
                     and any(ref.split(".")[0] == name for ref in node.inputs.values())), None)
    if gen_name is None or nodes[gen_name].model not in models:
        return  # typecheck names the missing generator or model
    gen = nodes[gen_name]
    model = gen.model
    checkpoint = models[model].checkpoint
    if checkpoint is None:
        raise JobError(f"dataset file {spec.file} is tokenized by the tokenizer of model {model!r} (which generates "
                       f"from it in node {gen_name!r}), but {model!r} has no checkpoint to read one from",
                       path=("nodes", name, "file"),
                       fix=f"set models.{model}.checkpoint to a Hugging Face folder or GGUF file with a tokenizer, or "
                           "give the node a `task:` instead")
    at_checkpoint = ("models", model, "checkpoint")
    if not has_tokenizer(checkpoint):
        raise JobError(f"checkpoint {checkpoint} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json), "
                       f"and dataset node {name!r} reads a file, which needs one", path=at_checkpoint,
                       fix="save the tokenizer beside the weights (tokenizer.save_pretrained(folder)), or "
                           "`graphrl import` the model with its tokenizer")
    tokenizer = _at(at_checkpoint, load_tokenizer, checkpoint)
    _at(at_checkpoint, stop_token_ids, tokenizer)  # its end-of-text token
    _at(("nodes", gen_name, "stop"), stop_token_ids, tokenizer, gen.stop)
    at_template = ("nodes", name, "chat_template")
    checked = rows if spec.long_prompts == "refuse" else rows[:1]  # truncated prompts fit: rendering one tells
    try:
        token_rows = prompt_token_rows(spec, tokenizer, checked)
    except GraphRLError as exc:
        raise type(exc)(exc.message, path=at_template, fix=exc.fix) from None
    except Exception as exc:  # noqa: BLE001 - a template the tokenizer carries fails inside jinja
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise JobError(f"rendering a prompt of {spec.file} with the chat template of {checkpoint} failed "
                       f"({type(exc).__name__}: {reason})", path=at_template,
                       fix="set chat_template: false, or repair the template in the checkpoint's tokenizer_config.json") from None
    _at(("nodes", name, "prompt_len"), check_prompt_lengths, spec, token_rows)


def left_padded(token_rows: list[list[int]], length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids [N, length], mask) left-padded; a longer row keeps its last `length` tokens (the end of a
    chat-templated prompt is the question and the turn the model answers)."""
    import torch

    ids = torch.full((len(token_rows), length), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(token_rows), length), dtype=torch.bool)
    for i, row in enumerate(token_rows):
        row = row[-length:]
        if row:
            ids[i, length - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[i, length - len(row):] = True
    return ids, mask


def step_indices(num_rows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Row indices of a step: positions [step*B, (step+1)*B) of epochs each shuffled from (seed, epoch)."""
    import torch

    out, perms = [], {}
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_033 + epoch))
        out.append(int(perms[epoch][offset]))
    return out


class PromptSource(Protocol):
    """What the executor draws prompts from: token rows per step, how responses end, how to read them."""

    stop_ids: list[int]
    pad_id: int

    def prompts(self, step: int) -> tuple[Tensor, Tensor]: ...

    def examples(self, step: int) -> list[Example] | None: ...

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]: ...


class TaskPrompts:
    """A registered task (the digit tasks): prompts drawn from a generator seeded by (seed, step)."""

    def __init__(self, spec: DatasetNode, seed: int, node: str = "dataset") -> None:
        assert spec.task is not None
        self.spec, self.seed, self.node = spec, seed, node
        factory = resolve_callable(spec.task, TASKS, "task")
        self.task = self._user_code("building it", lambda: factory(**spec.options))
        self.stop_ids, self.pad_id = [EOS], PAD

    def _user_code(self, doing: str, call: Callable[[], _T]) -> _T:
        """`call()`; an exception in the task's code (a user's `module:function`) names the node and the task."""
        try:
            return call()
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            raise RunError(f"dataset node {self.node!r}: task {self.spec.task!r} raised {type(exc).__name__} "
                           f"{doing}: {reason}", fix=f"fix the task {self.spec.task}") from exc

    def prompts(self, step: int) -> tuple[Tensor, Tensor]:
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self._user_code(f"drawing the prompts of step {step}",
                               lambda: self.task.sample(gen, self.spec.batch_size, self.spec.prompt_len))

    def examples(self, step: int) -> list[Example] | None:
        return None

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        return [" ".join(str(int(t)) for t in row[m]) for row, m in zip(ids.cpu(), mask.cpu().bool())]


class FilePrompts:
    """A JSON-lines / parquet file, rendered with the tokenizer's chat template and tokenized once."""

    def __init__(self, spec: DatasetNode, gen: GenerateNode, tokenizer: Any, seed: int) -> None:
        from graphrl.models.tokenizer import decode_responses, pad_token_id, stop_token_ids

        assert spec.file is not None
        self.spec, self.seed, self.tokenizer = spec, seed, tokenizer
        self.rows = read_examples(spec.file, spec.fields)
        token_rows = prompt_token_rows(spec, tokenizer, self.rows)
        check_prompt_lengths(spec, token_rows)
        self.ids, self.mask = left_padded(token_rows, spec.prompt_len, pad_token_id(tokenizer))
        self.stop_ids = stop_token_ids(tokenizer, gen.stop)
        self.pad_id = pad_token_id(tokenizer)
        self._decode = decode_responses

    def _indices(self, step: int) -> list[int]:
        return step_indices(len(self.rows), self.spec.batch_size, step, self.seed)

    def prompts(self, step: int) -> tuple[Tensor, Tensor]:
        import torch

        index = torch.tensor(self._indices(step))
        return self.ids[index], self.mask[index]

    def examples(self, step: int) -> list[Example]:
        return [self.rows[i] for i in self._indices(step)]

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        return self._decode(self.tokenizer, ids, mask)


def prompt_source(job: JobSpec, spec: DatasetNode, gen: GenerateNode) -> PromptSource:
    """The dataset node's prompts; a file dataset reads the generating model's checkpoint tokenizer."""
    if spec.file is None:
        return TaskPrompts(spec, job.run.seed, next((n for n, node in job.nodes.items() if node == spec), "dataset"))
    from graphrl.models.tokenizer import load_tokenizer

    checkpoint = job.models[gen.model].checkpoint
    if checkpoint is None:
        raise GraphRLError(f"dataset file {spec.file} needs a tokenizer, but model {gen.model!r} has no checkpoint",
                           fix=f"set models.{gen.model}.checkpoint to a Hugging Face folder or GGUF file")
    return FilePrompts(spec, gen, load_tokenizer(checkpoint), job.run.seed)
