"""The typecheck pass: every data edge is well typed and every symbolic size has one value.

Checks, each failing with the place in the job file and a fix:
- data edges form a DAG;
- every required input port has its producer, and every produced output that must be consumed is;
- the producer's schema provides every field the consumer's port declares, with the same dtype and rank;
- symbolic sizes unify along edges and agree with the sizes nodes bind (batch size, prompt length,
  group size, response length): one union-find over (node, symbol) pairs, walked in topological order
  so a conflict is reported at the first input that contradicts what is already known;
- reward functions and tasks resolve; a KL penalty has its reference log-probs;
- placement pins name roles of the job and can be held: tp splits the model's heads, pp its layers and,
  once the cluster is known (`graphrl compile`, or `validate` of a job that names its cluster), every
  pinned axis and their product fit the devices the role's mesh can have. A pin the hardware cannot
  hold is refused here, naming the field, instead of leaving the search without a candidate or the
  run to crash. So is a pin the executors do not run (`graphrl.schemas.capabilities`): a ZeRO stage
  with one data-parallel rank, an fp8 trainer, and, for `run` (and `validate`), a pp > 1 or a float16
  trainer; `compile` still lays those out for the preview.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

import networkx as nx

from graphrl.engine_support import ENGINE_MAX_TP, ENGINE_PRECISIONS, VLLM_INSTALL, engine_available
from graphrl.errors import JobError, PlacementError
from graphrl.ir import DataEdge, JobGraph
from graphrl.ops import OPS, op_kind
from graphrl.schemas.algorithms import ESTIMATORS, LOSSES
from graphrl.schemas.capabilities import Refusal, Target, dtype_refusal, precision_refusal, train_layout_refusal
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.job import RoleHint, parse_device_range
from graphrl.tasks import REWARDS, TASKS, resolve_callable

from graphrl.compiler.layouts import device_splits, generate_shapes, tp_split_problem, train_shapes
from graphrl.compiler.roles import Role, derive_roles


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
    resolved: dict[str, dict[str, int]] = {}
    for node in graph.nodes():
        symbols = {d for p in _all_ports(node) for f in p.fields.values() for d in f.shape if isinstance(d, str)}
        resolved[node.name] = {s: v for s in sorted(symbols) if (v := sizes.resolve((node.name, s))) is not None}
    return resolved


def _all_ports(node) -> list:  # noqa: ANN001
    ports = op_kind(node.spec).ports(node.spec)
    return [p.schema for p in ports.inputs.values()] + [p.schema for p in ports.outputs.values()]


def _check_references(graph: JobGraph) -> None:
    for node in graph.nodes():
        spec = node.spec
        if node.op == "reward" and spec.fn is not None:
            try:
                resolve_callable(spec.fn, REWARDS, "reward function")
            except LookupError as exc:
                raise JobError(str(exc), path=("nodes", node.name, "fn"),
                               fix="use a registered rule or a 'module:function' on PYTHONPATH") from None
        if node.op == "reward" and spec.rules:
            from graphrl.rewards import ANSWER_RULES

            for rule in spec.rules:
                try:
                    resolve_callable(rule, ANSWER_RULES, "answer reward rule")
                except LookupError as exc:
                    raise JobError(str(exc), path=("nodes", node.name, "rules", rule),
                                   fix="use a registered answer rule or a 'module:function' on PYTHONPATH") from None
            if not any(n.op == "dataset" and n.spec.file is not None for n in graph.nodes()):
                raise JobError("answer rules compare responses with a dataset's answers, but no dataset reads a file",
                               path=("nodes", node.name, "rules"), fix="give the dataset node a `file:`, or use `fn:`")
        if node.op == "dataset" and spec.task is not None:
            try:
                resolve_callable(spec.task, TASKS, "task")
            except LookupError as exc:
                raise JobError(str(exc), path=("nodes", node.name, "task"),
                               fix="use a registered task or a 'module:function' on PYTHONPATH") from None


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


# --- placement pins -----------------------------------------------------------------------------------

# Which pins each kind of role's layout reads: a trainer mesh is dp x fsdp x tp x pp with a sharding and
# optional offload; a generator is dp replicas of tp shards in some precision.
_AXES = {"train": ("dp", "fsdp", "tp", "pp"), "generate": ("dp", "tp")}
_USED = {"train": {"devices", "dp", "fsdp", "tp", "pp", "sharding", "offload"},
         "generate": {"devices", "dp", "tp", "precision", "engine"}}


def _mesh_splits(job, policy: Role | None, generator: Role | None, cluster: ClusterSpec) -> list[tuple[int, int]]:  # noqa: ANN001
    """(trainer devices, generator devices) of every mesh split the placement search tries: the whole
    cluster for both when colocated (device ranges do not apply there), and for disaggregated layouts
    the pinned ranges (one range implies the other) or every split at node granularity."""
    placement, n = job.placement, cluster.num_devices
    together = generator is None or any(generator.name in g and policy is not None and policy.name in g
                                        for g in placement.colocate)
    splits = [] if placement.strategy == "disaggregated" and not together else [(n, n)]
    if together or placement.strategy == "colocated":
        return splits
    hints = placement.roles
    own = {r: hints[r.name].devices for r in (policy, generator) if r is not None and r.name in hints}
    pairs = device_splits(n, cluster.devices_per_node, own.get(generator), own.get(policy))
    return splits + [(t_n, g_n) for _, g_n, _, t_n in pairs]


def _layout_exists(role: Role, hint: RoleHint, size: int, per_node: int) -> bool:
    """Whether some layout of `size` devices that the search enumerates honours the role's pins."""
    shapes = generate_shapes if role.kind == "generate" else train_shapes
    return bool(shapes(role, hint, size, per_node))


def _train_refusals(role: Role, hint: RoleHint, size: int, per_node: int, target: Target) -> list[Refusal] | None:
    """None when some trainer layout of `size` devices honouring the pins runs (for a preview: also one
    whose only preview-only choice is the pinned pp); else why each pinned layout does not."""
    shardings = [hint.sharding] if hint.sharding else ["none", "zero1", "zero2", "fsdp"]
    refusals = []
    for tp, pp, dp, fsdp in train_shapes(role, hint, size, per_node):
        for sharding in shardings:
            refusal = train_layout_refusal(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sharding=sharding)
            if refusal is None or (target == "preview" and refusal.field == "pp"):
                return None
            refusals.append(refusal)
    return refusals


def _where(sizes: set[int], own_range: str | None, colocated_only: bool) -> str:
    if colocated_only:
        return f"the {max(sizes)} devices of the cluster (a colocated layout uses them all)"
    if own_range is not None and len(sizes) == 1:
        return f"the {_devices(max(sizes))} of its range {own_range!r}"
    return f"{' or '.join(map(str, sorted(sizes)))} devices"


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def _check_pin_devices(job, key: str, role: Role, hint: RoleHint, policy: Role, generator: Role | None,  # noqa: ANN001
                       cluster: ClusterSpec, target: Target) -> None:
    """The role's pinned range lies in the cluster, and its pinned axes fit a mesh the search can give it."""
    path, n = ("placement", "roles", key), cluster.num_devices
    if hint.devices is not None and parse_device_range(hint.devices)[1] > n:
        raise PlacementError(f"device range {hint.devices!r} is outside the cluster's {n} devices (0-{n - 1})",
                             path=path + ("devices",), fix="pin a range inside the cluster")
    splits = _mesh_splits(job, policy, generator, cluster)
    sizes = {pair[0 if role is policy else 1] for pair in splits}
    if not sizes:
        raise PlacementError(f"the device ranges leave {key!r} no devices", path=path + ("devices",),
                             fix="pin ranges that split the cluster between the trainer and the generator")
    where = _where(sizes, hint.devices, splits == [(n, n)])
    axes = {a: getattr(hint, a) for a in _AXES[role.kind] if getattr(hint, a) is not None}
    for axis, size in axes.items():
        if size > max(sizes):
            raise PlacementError(f"{axis} {size} needs {size} devices; the mesh of {key!r} has {where}",
                                 path=path + (axis,), fix=f"pin {axis} <= {max(sizes)}, or use a larger cluster")
    product = math.prod(axes.values())
    spelled = " x ".join(f"{a} {v}" for a, v in axes.items())
    if not any(s % product == 0 for s in sizes):
        if len(axes) == 1:
            (axis,) = axes
            raise PlacementError(f"{axis} {product} does not divide {where}", path=path + (axis,),
                                 fix="pin a size that divides the mesh's devices")
        raise PlacementError(f"{spelled} = {_devices(product)} do not divide {where}", path=path,
                             fix="pin axes whose product divides the mesh's devices")
    if len(axes) == len(_AXES[role.kind]) and product not in sizes:
        raise PlacementError(f"{spelled} = {_devices(product)}, but the mesh of {key!r} has {where}", path=path,
                             fix=f"make the product of {', '.join(_AXES[role.kind])} equal the mesh's devices, "
                                 "or leave one axis unpinned")
    if not any(_layout_exists(role, hint, s, cluster.devices_per_node) for s in sizes):
        raise PlacementError(f"no {' x '.join(_AXES[role.kind])} layout of {where} holds these pins", path=path,
                             fix="loosen one of the pinned axes")
    if role.kind == "train":
        found = [_train_refusals(role, hint, s, cluster.devices_per_node, target) for s in sorted(sizes)]
        if all(f is not None for f in found):
            refusal = next(r for f in found if f for r in f)
            field = refusal.field if getattr(hint, refusal.field, None) is not None else "sharding"
            raise PlacementError(f"{refusal.why}; the executors do not run it on {where}", path=path + (field,),
                                 fix=refusal.fix)


def _check_pins_share_a_split(job, policy: Role, generator: Role, cluster: ClusterSpec) -> None:  # noqa: ANN001
    """Each role's pins fit some mesh on their own; both must fit the same split of the cluster."""
    def holds(role: Role, size: int) -> bool:
        hint = job.placement.roles.get(role.name)
        return hint is None or _layout_exists(role, hint, size, cluster.devices_per_node)

    splits = _mesh_splits(job, policy, generator, cluster)
    if not any(holds(policy, t) and holds(generator, g) for t, g in splits):
        n = cluster.num_devices
        pairs = ", ".join(f"both on {t}" if (t, g) == (n, n) else f"{t}+{g}" for t, g in splits)
        raise PlacementError(f"the pins of {policy.name!r} and {generator.name!r} fit no common split of the "
                             f"{n} devices (trainer+generator: {pairs})", path=("placement", "roles"),
                             fix="loosen the pins of one of the two roles")


def _check_pins(graph: JobGraph, cluster: ClusterSpec | None, target: Target = "preview") -> tuple[str, ...]:
    """Refuse pins no layout can hold (against the model, and against the cluster when it is known) and
    pins the executors do not run; warn about pins that the role's layout does not read."""
    job = graph.job
    placement = job.placement
    roles = {r.name: r for r in derive_roles(graph)}
    if target == "run":
        for r in roles.values():
            if (refusal := dtype_refusal(r.kind, job.models[r.model].dtype)) is not None:
                raise PlacementError(refusal.why, path=("models", r.model, "dtype"), fix=refusal.fix)
    # The search lays out the first trained model's mesh (every train and frozen role shares it) and the
    # first generator; see compiler/placement.py.
    policy = next((r for r in roles.values() if r.kind == "train"), None)
    generator = next((r for r in roles.values() if r.kind == "generate"), None)
    warnings: list[str] = []
    for i, group in enumerate(placement.colocate):
        for name in group:
            if name not in roles:
                raise PlacementError(f"unknown role {name!r} in a colocate group", path=("placement", "colocate", i),
                                     fix=f"roles of this job: {', '.join(roles)}")
    for key, hint in placement.roles.items():
        path = ("placement", "roles", key)
        role = roles.get(key)
        if role is None:
            raise PlacementError(f"unknown role {key!r}", path=path,
                                 fix=f"roles of this job: {', '.join(roles)} (a model's training copy is named "
                                     "after the model, its generation copy '<model>/generate')")
        pinned = {f for f, v in hint.model_dump().items() if v is not None}
        if hint.precision is not None and role.kind != "generate":
            refusal = precision_refusal(role.kind, hint.precision, hardware_fp8=True)
            raise PlacementError(f"only generation copies have a precision{f' ({refusal.why})' if refusal else ''}",
                                 path=path + ("precision",), fix=f"pin precision on '{role.model}/generate'")
        if target == "run" and role.kind == "train" and hint.pp is not None and \
                (refusal := train_layout_refusal(dp=1, fsdp=1, tp=1, pp=hint.pp, sharding="none")) is not None:
            raise PlacementError(refusal.why, path=path + ("pp",), fix=refusal.fix)
        if hint.engine is not None:
            _check_engine_pin(hint, role, path)
        if policy is None or role not in (policy, generator):
            if pinned:
                owner = policy.name if policy is not None else "the trainer"
                warnings.append(f"{'.'.join(path)}: ignored: {key!r} runs on the trainer's mesh in the layout "
                                f"of {owner!r}; pin {owner!r} instead")
            continue
        unused = sorted(pinned - _USED[role.kind])
        if unused:
            warnings.append(f"{'.'.join(path)}: {', '.join(unused)} ignored: a {role.kind} role's layout has no "
                            f"{'/'.join(unused)}")
        if hint.devices is not None and placement.strategy == "colocated":
            warnings.append(f"{'.'.join(path)}.devices: ignored: a colocated layout puts every role on every device")
        if hint.tp is not None and (why := tp_split_problem(role.dims, hint.tp, role.kind)) is not None:
            valid = [t for t in range(1, role.dims.num_heads + 1) if tp_split_problem(role.dims, t, role.kind) is None]
            raise PlacementError(f"{why} (model {role.model!r})", path=path + ("tp",),
                                 fix=f"use a tp that splits this model: {', '.join(map(str, valid))}")
        if role.kind == "train" and hint.pp is not None and hint.pp > role.dims.num_layers:
            raise PlacementError(f"pp {hint.pp} is larger than the {role.dims.num_layers} layers of {role.model}",
                                 path=path + ("pp",), fix=f"use pp <= {role.dims.num_layers}")
        if cluster is not None:
            _check_pin_devices(job, key, role, hint, policy, generator, cluster, target)
    if cluster is not None and policy is not None and generator is not None:
        _check_pins_share_a_split(job, policy, generator, cluster)
    return tuple(warnings)


def _check_engine_pin(hint: RoleHint, role: Role, path: tuple[str, ...]) -> None:
    """An engine is a choice of a generation copy, and it must be installed and able to hold the other pins."""
    engine = hint.engine
    assert engine is not None
    if role.kind != "generate":
        raise PlacementError(f"only generation copies run on an engine; {role.name!r} is a {role.kind} role",
                             path=path + ("engine",), fix=f"pin engine on '{role.model}/generate'")
    if not engine_available(engine):
        raise PlacementError(f"engine {engine!r} is not installed here (the vllm package cannot be imported)",
                             path=path + ("engine",), fix=f"{VLLM_INSTALL}; or use engine: native")
    max_tp = ENGINE_MAX_TP[engine]
    if max_tp is not None and hint.tp is not None and hint.tp > max_tp:
        raise PlacementError(f"engine {engine!r} runs one replica per rank here (tp <= {max_tp}), tp {hint.tp} is pinned",
                             path=path + ("tp",), fix=f"pin tp: {max_tp} (more replicas with dp), or engine: native")
    if hint.precision is not None and hint.precision not in ENGINE_PRECISIONS[engine]:
        raise PlacementError(f"engine {engine!r} does not run precision {hint.precision!r}",
                             path=path + ("precision",),
                             fix=f"use precision: {' or '.join(ENGINE_PRECISIONS[engine])}, or engine: native")


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
    _check_references(graph)
    warnings = _check_algorithm(graph) + _check_pins(graph, cluster, target)
    return graph.with_sizes(sizes).with_warnings(*warnings)


__all__ = ["OPS", "typecheck"]
