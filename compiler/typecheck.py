"""The typecheck pass: every data edge is well typed and every symbolic size has one value.

Checks, each failing with the place in the job file and a fix:
- data edges form a DAG;
- every required input port has its producer, and every produced output that must be consumed is;
- the producer's schema provides every field the consumer's port declares, with the same dtype and rank;
- symbolic sizes unify along edges and agree with the sizes nodes bind (batch size, prompt length,
  group size, response length): one union-find over (node, symbol) pairs, walked in topological order
  so a conflict is reported at the first input that contradicts what is already known;
- reward functions and tasks resolve and take the arguments the executors call them with (a registered
  task is built here with its options, as a rank builds it, and its prompts must fit prompt_len); an
  estimator with a group baseline (grpo, rloo) gets a group of two or more responses per prompt; a KL
  penalty has its reference log-probs;
- for `run` (and `validate`), every model's dtype is one the executors run (not a float16 trainer);
- placement pins are ones the placement search can lay out (`graphrl.compiler.candidates.check_pins`, the
  one check of them, which the search runs too): against the model, what the executors run, and, once
  the cluster is known (`graphrl compile`, or `validate` of a job that names its cluster), the meshes the
  search enumerates on it and its hardware. A pin is refused here naming its field, instead of leaving
  the search without a candidate or the run to crash.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Hashable

import networkx as nx

from graphrl.errors import JobError, PlacementError
from graphrl.ir import DataEdge, JobGraph
from graphrl.ops import OPS, op_kind
from graphrl.schemas.algorithms import ESTIMATORS, LOSSES
from graphrl.schemas.capabilities import Target, dtype_refusal
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.job import DatasetNode, GenerateNode
from graphrl.tasks import REWARD_ARGS, REWARDS, TASKS, DigitTask, call_mismatch, resolve_callable

from graphrl.compiler.candidates import check_pins
from graphrl.compiler.lengths import lengths_of
from graphrl.compiler.roles import derive_roles


@dataclass
class _Sizes:
    """Union-find over size variables; a class may carry a known value and where it came from."""

    parent: dict[Hashable, Hashable] = field(default_factory=dict)
    value: dict[Hashable, int] = field(default_factory=dict)
    origin: dict[Hashable, str] = field(default_factory=dict)

    def find(self, key: Hashable) -> Hashable:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def bind(self, key: Hashable, value: int, origin: str) -> str | None:
        """Give `key`'s class a value; return a conflict description or None."""
        root = self.find(key)
        if root in self.value and self.value[root] != value:
            return f"{value} ({origin}) contradicts {self.value[root]} ({self.origin[root]})"
        self.value.setdefault(root, value)
        self.origin.setdefault(root, origin)
        return None

    def unify(self, a: Hashable, b: Hashable) -> str | None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return None
        va, vb = self.value.get(ra), self.value.get(rb)
        if va is not None and vb is not None and va != vb:
            return f"{vb} ({self.origin[rb]}) contradicts {va} ({self.origin[ra]})"
        self.parent[rb] = ra
        if va is None and vb is not None:
            self.value[ra], self.origin[ra] = vb, self.origin[rb]
        return None

    def resolve(self, key: Hashable) -> int | None:
        return self.value.get(self.find(key))


def _dim_key(node: str, dim: str | int) -> Hashable:
    return ("const", dim) if isinstance(dim, int) else (node, dim)


def _check_acyclic(graph: JobGraph) -> None:
    try:
        cycle = nx.find_cycle(graph.data_view())
    except nx.NetworkXNoCycle:
        return
    names = [u for u, _ in cycle] + [cycle[0][0]]
    raise JobError(
        f"data edges form a cycle: {' -> '.join(names)}",
        path=("nodes", cycle[-1][1], "inputs"),
        fix="only weights may flow back to an earlier step; break the cycle of data references",
    )


def _producers_of(graph: JobGraph, schema_fields: set[str]) -> list[str]:
    """Output ports that could feed an input needing `schema_fields`, for fix suggestions."""
    hits = []
    for node in graph.nodes():
        for port, out in op_kind(node.spec).ports(node.spec).outputs.items():
            if schema_fields <= set(out.schema.fields):
                hits.append(f"{node.name}.{port}")
    return hits


def _check_ports(graph: JobGraph) -> None:
    # Missing inputs first: a missing input also leaves its would-be producer unconsumed, and the
    # missing input is the mistake to report.
    for node in graph.nodes():
        ports = op_kind(node.spec).ports(node.spec)
        connected = {e.dst_port for e in graph.in_edges(node.name)}
        for port, spec in ports.inputs.items():
            if spec.required and port not in connected:
                candidates = _producers_of(graph, set(spec.schema.fields))
                hint = f"e.g. '{port}: {candidates[0]}'" if candidates else "add a node that produces it"
                raise JobError(
                    f"required input port {port!r} of {node.op} node {node.name!r} is not connected",
                    path=("nodes", node.name, "inputs"), fix=f"connect it, {hint}",
                )


def _check_consumed(graph: JobGraph) -> None:
    for node in graph.nodes():
        ports = op_kind(node.spec).ports(node.spec)
        consumed = {e.src_port for e in graph.out_edges(node.name)}
        for port, out in ports.outputs.items():
            if out.must_consume and port not in consumed:
                raise JobError(
                    f"output {node.name}.{port} is produced but never used",
                    path=("nodes", node.name),
                    fix=f"connect '{node.name}.{port}' to an input that needs it, or remove the node",
                )


def _check_edge_schema(graph: JobGraph, edge: DataEdge) -> None:
    dst = graph.node(edge.dst)
    want = op_kind(dst.spec).ports(dst.spec).inputs[edge.dst_port].schema
    path = ("nodes", edge.dst, "inputs", edge.dst_port)
    ref = f"{edge.src}.{edge.src_port}"
    for name, field_ in want.fields.items():
        have = edge.schema.fields.get(name)
        if have is None:
            raise JobError(
                f"schema mismatch: port {edge.dst_port!r} needs field {name!r}, which {ref} does not provide "
                f"(it provides {', '.join(edge.schema.fields)})",
                path=path,
                fix="connect an output that provides it: " + (", ".join(_producers_of(graph, set(want.fields))) or "none exists"),
            )
        if have.dtype != field_.dtype or len(have.shape) != len(field_.shape):
            raise JobError(
                f"schema mismatch on field {name!r}: {ref} gives {have}, port {edge.dst_port!r} needs {field_}",
                path=path, fix="connect an output of the right type",
            )


def _unify_shapes(graph: JobGraph) -> dict[str, dict[str, int]]:
    sizes = _Sizes()
    for dim in {d for n in graph.nodes() for p in _all_ports(n) for f in p.fields.values() for d in f.shape}:
        if isinstance(dim, int):
            sizes.bind(("const", dim), dim, "fixed size")
    for name in graph.topo_order():
        node = graph.node(name)
        kind = op_kind(node.spec)
        want = kind.ports(node.spec).inputs
        for edge in sorted(graph.in_edges(name), key=lambda e: e.dst_port):
            for field_name, field_ in want[edge.dst_port].schema.fields.items():
                have = edge.schema.fields[field_name]
                for axis, (src_dim, dst_dim) in enumerate(zip(have.shape, field_.shape)):
                    conflict = sizes.unify(_dim_key(edge.src, src_dim), _dim_key(name, dst_dim))
                    if conflict:
                        raise JobError(
                            f"shape mismatch: {field_name} dimension {axis} ({dst_dim}) from "
                            f"{edge.src}.{edge.src_port}: {conflict}",
                            path=("nodes", name, "inputs", edge.dst_port),
                            fix="make the producing nodes agree on batch size, prompt and response lengths",
                        )
        for symbol, value in kind.bindings(node.spec).items():
            conflict = sizes.bind((name, symbol), value, f"set by nodes.{name}")
            if conflict:
                raise JobError(
                    f"shape mismatch: {symbol} = {conflict}", path=("nodes", name),
                    fix="make the producing nodes agree on batch size, prompt and response lengths",
                )
        if node.op == "generate":
            batch = sizes.resolve((name, "B"))
            if batch is not None:
                conflict = sizes.bind((name, "N"), batch * node.spec.samples_per_prompt, f"B x G at nodes.{name}")
                if conflict:
                    raise JobError(f"shape mismatch: N = {conflict}", path=("nodes", name, "samples_per_prompt"))
            prompt_len = sizes.resolve((name, "P"))
            if node.spec.env is not None and prompt_len is not None:
                _bind_episode_len(sizes, name, node.spec, prompt_len)
    resolved: dict[str, dict[str, int]] = {}
    for node in graph.nodes():
        symbols = {d for p in _all_ports(node) for f in p.fields.values() for d in f.shape if isinstance(d, str)}
        resolved[node.name] = {s: v for s in sorted(symbols) if (v := sizes.resolve((node.name, s))) is not None}
    return resolved


def _bind_episode_len(sizes: _Sizes, name: str, spec: GenerateNode, prompt_len: int) -> None:
    """An episode's response columns R: its `max_total_tokens` less the prompt, room for one turn at least."""
    env = spec.env
    assert env is not None
    if env.max_total_tokens < prompt_len + spec.max_new_tokens:
        raise JobError(f"env.max_total_tokens {env.max_total_tokens} leaves no room for one turn: the prompt takes "
                       f"{prompt_len} tokens and a turn up to max_new_tokens {spec.max_new_tokens}",
                       path=("nodes", name, "env", "max_total_tokens"),
                       fix=f"set it to at least {prompt_len + spec.max_new_tokens} (the prompt, then max_turns "
                           f"{env.max_turns} turns and the environment's replies)")
    conflict = sizes.bind((name, "R"), spec.response_len(prompt_len), f"env.max_total_tokens - P at nodes.{name}")
    if conflict:
        raise JobError(f"shape mismatch: R = {conflict}", path=("nodes", name, "env", "max_total_tokens"))


def _check_env(graph: JobGraph, name: str, spec: GenerateNode) -> None:
    """A generate node's environment: a class that `reset(row)` and `step(text)` can be called on, built with
    its options; its dataset gives the text the episodes are told in."""
    from graphrl.envs import env_class, method_mismatch, options_mismatch

    env = spec.env
    assert env is not None
    path = ("nodes", name, "env", "class")
    try:
        cls = env_class(env.cls)
    except LookupError as exc:
        raise JobError(str(exc), path=path, fix="name a built-in environment or a 'module:Class' on PYTHONPATH "
                                                "(the job file's folder is on it)") from None
    if (problem := method_mismatch(cls)) is not None:
        raise JobError(f"environment {env.cls!r} cannot run episodes: {problem}", path=path,
                       fix="give the class reset(self, row) returning the first message and step(self, text) "
                           "returning (observation, reward, done)")
    if (problem := options_mismatch(cls, dict(env.options))) is not None:
        raise JobError(f"environment {env.cls!r}: {problem}", path=("nodes", name, "env", "options"),
                       fix="give only options its constructor takes")
    source = graph.node(graph.in_edges(name)[0].src).spec if graph.in_edges(name) else None
    if isinstance(source, DatasetNode) and source.task is not None and not source.task.startswith("digits-"):
        raise JobError(f"an environment talks in text, but task {source.task!r} has no text form",
                       path=("nodes", name, "env"), fix="use a file dataset (read with the model's tokenizer) or a "
                                                        "digits-* task")


def _all_ports(node) -> list:  # noqa: ANN001
    ports = op_kind(node.spec).ports(node.spec)
    return [p.schema for p in ports.inputs.values()] + [p.schema for p in ports.outputs.values()]


def _check_references(graph: JobGraph) -> None:
    for node in graph.nodes():
        spec = node.spec
        if node.op == "reward" and spec.fn is not None:
            _check_reward_fn(node.name, spec.fn)
        if node.op == "reward" and spec.rules:
            from graphrl.rewards import ANSWER_RULE_ARGS, ANSWER_RULES

            for rule in spec.rules:
                path = ("nodes", node.name, "rules", rule)
                try:
                    fn = resolve_callable(rule, ANSWER_RULES, "answer reward rule")
                except LookupError as exc:
                    raise JobError(str(exc), path=path,
                                   fix="use a registered answer rule or a 'module:function' on PYTHONPATH") from None
                if (mismatch := call_mismatch(fn, ANSWER_RULE_ARGS)) is not None:
                    raise JobError(f"answer rule {rule!r} cannot be called as fn({', '.join(ANSWER_RULE_ARGS)}): "
                                   f"{mismatch}", path=path,
                                   fix=f"define it as def {getattr(fn, '__name__', 'rule')}"
                                       f"({', '.join(ANSWER_RULE_ARGS)}) returning a number")
            if not any(n.op == "dataset" and n.spec.file is not None for n in graph.nodes()):
                raise JobError("answer rules compare responses with a dataset's answers, but no dataset reads a file",
                               path=("nodes", node.name, "rules"), fix="give the dataset node a `file:`, or use `fn:`")
        if node.op == "dataset" and spec.task is not None:
            _check_task(node.name, spec)
        if node.op == "generate" and spec.env is not None:
            _check_env(graph, node.name, spec)


def _check_reward_fn(name: str, ref: str) -> None:
    """`fn` resolves to a function the executor can call as fn(prompt_ids, prompt_mask, response_ids,
    response_mask), as its `reward` does on every step."""
    path = ("nodes", name, "fn")
    try:
        fn = resolve_callable(ref, REWARDS, "reward function")
    except LookupError as exc:
        raise JobError(str(exc), path=path, fix="use a registered rule or a 'module:function' on PYTHONPATH") from None
    if (mismatch := call_mismatch(fn, REWARD_ARGS)) is not None:
        raise JobError(f"reward function {ref!r} cannot be called as fn({', '.join(REWARD_ARGS)}): {mismatch}",
                       path=path, fix=f"define it as def {getattr(fn, '__name__', 'reward')}({', '.join(REWARD_ARGS)}) "
                                      "returning one reward per response")


def _check_task(name: str, spec: DatasetNode) -> None:
    """`task` resolves, takes the node's `options`, and (a registered task, cheap to build) is built with them
    as a rank builds it, its prompts fitting `prompt_len`."""
    try:
        factory = resolve_callable(spec.task, TASKS, "task")
    except LookupError as exc:
        raise JobError(str(exc), path=("nodes", name, "task"),
                       fix="use a registered task or a 'module:function' on PYTHONPATH") from None
    options = ("nodes", name, "options")
    takes, open_ended = _parameters(factory)
    takes = [p for p in takes if not p.startswith("_")]
    unknown = [key for key in spec.options if key not in takes] if not open_ended else []
    if unknown:
        close = difflib.get_close_matches(unknown[0], takes, n=1)
        raise JobError(f"task {spec.task!r} has no option {unknown[0]!r}", path=options + (unknown[0],),
                       fix=(f"did you mean {close[0]!r}? " if close else "")
                           + (f"its options: {', '.join(takes)}" if takes else "it takes no options: remove it"))
    if (mismatch := call_mismatch(factory, kwargs=spec.options)) is not None:
        raise JobError(f"task {spec.task!r} cannot be built with these options: {mismatch}", path=options,
                       fix=f"its options: {', '.join(takes)}" if takes else "it takes no options: remove them")
    # An error of a value is that option's when the node sets one only.
    options = options + tuple(spec.options) if len(spec.options) == 1 else options
    if TASKS.get(spec.task) is None:
        return  # a user's factory may load data: a rank builds it
    try:
        task = factory(**spec.options)
    except (TypeError, ValueError) as exc:
        raise JobError(f"task {spec.task!r}: {exc}", path=options,
                       fix=f"give its options ({', '.join(takes)}) values it accepts") from None
    if isinstance(task, DigitTask) and spec.prompt_len < task.prompt_tokens:
        raise JobError(f"prompt_len {spec.prompt_len} is shorter than the {task.prompt_tokens} tokens every prompt of "
                       f"task {spec.task!r} has (BOS, {task.num_digits} digits, SEP)", path=("nodes", name, "prompt_len"),
                       fix=f"set prompt_len to at least {task.prompt_tokens}")


def _parameters(fn) -> tuple[list[str], bool]:  # noqa: ANN001
    """The parameter names of `fn`, and whether it takes any keyword (**kwargs, or no signature to read)."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return [], True
    return ([p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)],
            any(p.kind is p.VAR_KEYWORD for p in parameters))


def _check_groups(graph: JobGraph) -> None:
    """An estimator whose baseline is the other responses to the same prompt (grpo, rloo) needs two or more
    of them: the executor's group statistics refuse a group of one, at the first step."""
    for node in graph.nodes():
        if node.op != "advantage" or not ESTIMATORS[node.spec.estimator].group_baseline:
            continue
        for edge in graph.in_edges(node.name):
            source = graph.node(edge.src)
            if edge.dst_port != "rollouts" or source.op != "generate" or source.spec.samples_per_prompt >= 2:
                continue
            others = ", ".join(n for n in ESTIMATORS.names() if not ESTIMATORS[n].group_baseline)
            raise JobError(
                f"estimator {node.spec.estimator!r} of node {node.name!r} takes each response's baseline from the "
                f"other responses to its prompt, but {source.name!r} samples {source.spec.samples_per_prompt} "
                "response per prompt", path=("nodes", source.name, "samples_per_prompt"),
                fix=f"set samples_per_prompt to 2 or more (the group of responses to each prompt), or use an estimator "
                    f"without a group baseline ({others})")


def _check_kl(graph: JobGraph) -> tuple[str, ...]:
    """The KL penalty: an estimator whose gradient (in the loss) or value (in the reward) means something
    where it acts, and the reference log-probs wired to the node that uses them."""
    a = graph.job.algorithm
    if a.kl_coef == 0:
        return ()
    warnings: list[str] = []
    if a.kl_in == "loss" and a.kl_estimator == "k1":
        raise JobError("kl_estimator k1 in the loss has zero expected gradient on-policy: it adds noise, not a "
                       "penalty", path=("algorithm", "kl_estimator"),
                       fix="use kl_estimator: k2 or k3_is (gradient of KL(pi || ref)) or k3 (of KL(ref || pi)), "
                           "or put k1 in the reward with kl_in: reward")
    if a.kl_in == "reward" and a.kl_estimator == "k3_is":
        raise JobError("kl_estimator k3_is corrects the gradient of a loss term; a reward has no gradient",
                       path=("algorithm", "kl_estimator"),
                       fix="use kl_estimator: k1 (the usual reward penalty), k2 or k3 with kl_in: reward")
    users = "train" if a.kl_in == "loss" else "advantage"
    for node in graph.nodes():
        ports = {e.dst_port for e in graph.in_edges(node.name)}
        if node.op == "train" and LOSSES[node.spec.loss].trains == "policy" and a.kl_in == "reward" \
                and "ref_logprobs" in ports:
            warnings.append(f"nodes.{node.name}.inputs.ref_logprobs: ignored: the KL is in the reward "
                            "(algorithm.kl_in: reward)")
        if node.op == "advantage" and a.kl_in == "loss" and "ref_logprobs" in ports:
            warnings.append(f"nodes.{node.name}.inputs.ref_logprobs: ignored: the KL is in the loss "
                            "(algorithm.kl_in: loss)")
        if node.op != users or (users == "train" and LOSSES[node.spec.loss].trains == "critic"):
            continue
        if users == "advantage" and not ESTIMATORS[node.spec.estimator].token_rewards:
            shaped = ", ".join(n for n in ESTIMATORS.names() if ESTIMATORS[n].token_rewards)
            raise JobError(f"kl_in is reward, but estimator {node.spec.estimator!r} of node {node.name!r} has no "
                           "per-token rewards to shape", path=("algorithm", "kl_in"),
                           fix=f"use kl_in: loss, or an estimator that shapes token rewards ({shaped})")
        if "ref_logprobs" not in ports:
            raise JobError(
                f"kl_coef is {a.kl_coef} but {node.op} node {node.name!r} has no 'ref_logprobs' input",
                path=("algorithm", "kl_coef"),
                fix=f"connect nodes.{node.name}.inputs.ref_logprobs to a reference logprob node, or set kl_coef: 0",
            )
    return tuple(warnings)


def _check_algorithm(graph: JobGraph) -> tuple[str, ...]:
    job = graph.job
    warnings: list[str] = list(_check_kl(graph))
    for node in graph.nodes():
        if node.op != "train" or LOSSES[node.spec.loss].trains == "critic":
            continue
        if job.schedule.mode == "async" and not LOSSES[node.spec.loss].off_policy:
            corrected = ", ".join(name for name in LOSSES.names() if LOSSES[name].off_policy)
            warnings.append(
                f"nodes.{node.name}.loss: schedule is async but loss is {node.spec.loss!r}; off-policy "
                f"batches are not importance-corrected (use loss: {corrected})"
            )
    return tuple(warnings)


def _check_router_replay(graph: JobGraph) -> None:
    """Routing replay needs a trained mixture-of-experts policy."""
    replay = graph.job.algorithm.router_replay
    if replay == "none":
        return
    trained = {node.spec.model for node in graph.nodes() if node.op == "train"
               and LOSSES[node.spec.loss].trains != "critic"}
    dense = sorted(m for m in trained if not graph.job.models[m].resolved_dims().is_moe)
    if dense:
        raise JobError(f"router_replay {replay} replays the routes of a mixture of experts, but {dense[0]!r} is a "
                       "dense model", path=("algorithm", "router_replay"),
                       fix="set router_replay: none, or train a mixture-of-experts model (qwen2_moe, qwen3_moe)")
    if replay == "R3" and (episodic := next((n.name for n in graph.nodes() if n.op == "generate" and n.spec.env),
                                            None)):
        raise JobError(f"router_replay R3 replays the generator's routes, but the episodes of {episodic!r} do not "
                       "record them (each turn is a generation of its own)", path=("algorithm", "router_replay"),
                       fix="use R2 (the trainer's own first-pass routing) or none for a job with an environment")


def _check_mini_batch(graph: JobGraph, sizes: dict[str, dict[str, int]]) -> None:
    """`algorithm.mini_batch_size` cuts the batch of responses into equal optimizer steps: it must divide it."""
    mini = graph.job.algorithm.mini_batch_size
    if mini == 0:
        return
    for node in graph.nodes():
        if node.op != "generate":
            continue
        responses = sizes[node.name].get("N")
        if responses is not None and responses % mini:
            raise JobError(
                f"mini_batch_size {mini} does not divide the batch of {responses} responses (node {node.name!r})",
                path=("algorithm", "mini_batch_size"),
                fix=f"use a divisor of {responses}, e.g. {_largest_divisor_at_most(responses, mini)}, or 0 for one "
                    "optimizer step per pass")


def _check_lengths(graph: JobGraph) -> None:
    """A generate node's `response_tokens` is a distribution the preview can hold (`lengths_of`)."""
    for node in graph.nodes():
        if node.op != "generate":
            continue
        try:
            lengths_of(node.spec.response_tokens, node.spec.max_new_tokens)
        except ValueError as exc:
            raise JobError(str(exc), path=("nodes", node.name, "response_tokens", "p90"),
                           fix="give a p90 nearer the mean, or leave it out") from None


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check_model_dtypes(graph: JobGraph, target: Target) -> None:
    """For `run`, every model's dtype is one the executors run for each of its roles (a float16 trainer is
    preview-only: `graphrl.schemas.capabilities`)."""
    if target != "run":
        return
    for role in derive_roles(graph):
        if (refusal := dtype_refusal(role.kind, graph.job.models[role.model].dtype)) is not None:
            raise PlacementError(refusal.why, path=("models", role.model, "dtype"), fix=refusal.fix)


def typecheck(graph: JobGraph, cluster: ClusterSpec | None = None, target: Target = "preview") -> JobGraph:
    """Ports, schemas, symbolic shapes, producers and references of the job graph (and the placement pins
    against `cluster`, when given, and against what the executors run for `target` 'run'); the graph with
    its symbolic sizes and the warnings."""
    _check_acyclic(graph)
    _check_ports(graph)
    for edge in graph.data_edges():
        _check_edge_schema(graph, edge)
    # After the schemas: a miswired input also leaves its intended producer unused, and the miswiring
    # is the mistake to report.
    _check_consumed(graph)
    sizes = _unify_shapes(graph)
    _check_mini_batch(graph, sizes)
    _check_lengths(graph)
    _check_references(graph)
    _check_groups(graph)
    _check_router_replay(graph)
    _check_model_dtypes(graph, target)
    warnings = _check_algorithm(graph) + check_pins(graph, cluster, target)
    return graph.with_sizes(sizes).with_warnings(*warnings)


__all__ = ["OPS", "typecheck"]
