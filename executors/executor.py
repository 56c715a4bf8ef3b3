"""The rank executor: one process interprets its rank's program, instruction by instruction.

It builds only the roles placed on its rank, then walks its instruction stream through one dispatch
table keyed by instruction type. Each handler checks its preconditions (the weight version it is about
to use, the batch it expects) and fails with a `RunError` naming the rank, the instruction index and
the reason, never with a silent stale read.

Data of a step lives in `self.values[(step, node, port)]` for this rank's range of responses; rollouts
arrive in pieces (from one or several generator replicas) and are joined when a consumer reads them.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from graphrl.errors import RunError
from graphrl.schemas.sharding import is_adapter
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.schemas.algorithms import ESTIMATORS, LOSSES
from graphrl.schemas.plan import Plan
from graphrl.schemas.program import (
    Advantage,
    Checkpoint,
    Generate,
    Instruction,
    Logprob,
    Offload,
    Onload,
    Programs,
    Recv,
    ReleaseWeights,
    ReshardInPlace,
    Reward,
    Send,
    TrainStep,
    TRAITS,
    Value,
    WeightSync,
    checkpoint_due,
    describe,
)
from graphrl.datasets import prompt_source
from graphrl.ops import EPISODE_FIELD, LOSS_MASK_FIELD, ROUTES_FIELD, episode_width, route_width
from graphrl.rewards import RewardRuleError, combined_reward
from graphrl.tasks import REWARDS, resolve_callable

from graphrl.executors import algorithms as alg
from graphrl.executors import fp8, training
from graphrl.executors.guards import check_rewards, reward_tensor
from graphrl.executors.engines import EngineContext, GenerationEngine, GenerationRequest, build_engine
from graphrl.executors.episodes import (EpisodeRunner, EpisodeSettings, Replica, codec_of, episode_metrics, episode_rows,
                                        episode_samples, episode_sums, last_turn_mask)
from graphrl.executors.models.lora import adapters_off, generator_version
from graphrl.executors.models.sampling import sampling_temperature, token_logprobs_and_entropy, token_values
from graphrl.executors.checkpointing import load_inflight, load_role_state, write_checkpoint
from graphrl.executors.outputs import EnvErrorsWriter, MetricsWriter, SamplesWriter, checkpoint_layout, versions_ahead_file
from graphrl.executors.parallel import copy_full_weights, full_state_dict, gather_in_place, release_gathered
from graphrl.executors.roles import DTYPES, RoleState, build_roles, role_group
from graphrl.executors.rollouts import Piece, join_rollouts, recv_piece, send_piece
from graphrl.executors.profiling import ProfileSettings, RankProfiler, SpanRecorder, now
from graphrl.executors.runtime import Runtime
from graphrl.executors.stopping import RunStopped, StopRequests
from graphrl.executors.tensor_parallel import TensorParallelLlama
from graphrl.executors.weightsync import check_delivery, probe_logprobs, probe_mismatch, run_weight_sync

def step_lag(programs: Programs, rank: int) -> int:
    """How many steps behind the newest step it has seen an instruction of `rank`'s stream can be: 0
    when a rank finishes each step before starting the next, up to the staleness of an asynchronous
    schedule. The stream is periodic, so a window holding every prologue, two body iterations and every
    epilogue shows every lag the whole run has."""
    newest, lag = -1, 0
    steps = programs.window_steps(2)
    window = programs if steps == programs.steps else programs.with_steps(steps)
    for ins in window.rank_stream(rank):
        step = getattr(ins, "step", None)
        if step is not None:
            newest = max(newest, step)
            lag = max(lag, newest - step)
    return lag


@dataclass
class StepStats:
    reward_sum: float = 0.0
    reward_count: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class RankExecutor:
    """Interprets this rank's periodic program (prologue, body once per step, epilogue) on one process of a
    torch.distributed job."""

    def __init__(self, plan: Plan, runtime: Runtime, out_dir: Path, *, start_step: int = 0,
                 resume_state: dict[str, Any] | None = None, profile: ProfileSettings | None = None,
                 stop: StopRequests | None = None) -> None:
        if plan.programs is None:
            raise RunError("the plan has no programs", fix="compile it with `graphrl compile JOB -o plan.msgpack`")
        self.plan = plan
        self.job = plan.job
        self.rt = runtime
        self.rank = runtime.rank
        self.out_dir = out_dir
        self.programs = plan.programs
        if plan.bindings is None:
            raise RunError("the plan binds no nodes or roles for the executors", fix="compile it again")
        self.bindings = plan.bindings
        self.nodes = plan.bindings.nodes
        gen_node = self.nodes[plan.bindings.generate_node]
        data_node = self.nodes[plan.bindings.dataset_node]
        self.gen_node, self.data_node = gen_node, data_node
        # The policy is the model the rollouts are sampled from; its training role is named after it.
        self.policy_role = plan.bindings.policy_model
        self.last_train_node = plan.bindings.last_train_node
        self.group_size = gen_node.spec.samples_per_prompt
        self.seed = plan.job.run.seed
        # Scoring an unwrapped model packs sequences as the job says; wrapped ones were built packing.
        self.pack = plan.job.algorithm.pack_sequences
        self.source = prompt_source(plan.job, data_node.spec, gen_node.spec)
        # A mixture of experts' native generator records the routes its rollouts carry (R2/R3, the mismatch).
        engines = {p.engine for p in plan.chosen.placements if p.kind == "generate"}
        self.route_width = route_width(plan.job.models[gen_node.spec.model].resolved_dims()) \
            if engines == {"native"} and gen_node.spec.env is None else 0
        # R: max_new_tokens, or with an environment the episode's tokens after its prompt.
        self.response_len = gen_node.spec.response_len(data_node.spec.prompt_len)
        self.episode_width = episode_width(gen_node.spec.env)
        self.episodes: EpisodeRunner | None = None  # built at the first generation of an episode node
        self.router_replay = plan.job.algorithm.router_replay
        self.samples = SamplesWriter(out_dir, plan.job.run.samples_per_step)
        self.env_errors = EnvErrorsWriter(out_dir, self.rank)
        self.start_step = start_step
        self.values: dict[tuple[int, str, str], Any] = {}
        self.pieces: dict[int, list[Piece]] = {}
        # A step's rollouts and values older than the newest step seen minus this lag are never read again here.
        self.data_lag = step_lag(plan.programs, self.rank)
        self.newest_step = -1
        self.stats: dict[int, StepStats] = {}
        self.step_started: dict[int, float] = {}
        self.last_train_end = time.perf_counter()
        self.restored_steps: frozenset[int] = frozenset()
        # Weight versions a longer run's generator reads after this run's last step (an asynchronous
        # schedule generates step k+1 with weights older than the last ones): kept as they are trained,
        # written into the last checkpoint, so `--resume` to more steps continues this run exactly.
        self.versions_for_continuation = self._versions_a_continuation_reads()
        self.kept_versions: dict[int, dict[str, Tensor]] = {}
        self.saved_versions: dict[tuple[str, int], Path] = {}
        self.roles, self.mesh_groups = build_roles(plan, runtime)
        if resume_state is not None:
            self._resume(resume_state)
        self.engines = self._start_engines()
        self.metrics = MetricsWriter(out_dir, enabled=self.is_reporter, tensorboard=plan.job.run.tensorboard)
        self.dispatch: dict[type, Callable[[Any], None]] = {
            kind: handler.__get__(self) for kind, handler in HANDLERS.items()}
        self.index = 0
        # Stop requests (Ctrl-C, SIGTERM) end the run at a step boundary the trainer ranks agree on.
        self.stop = stop if stop is not None else StopRequests()
        self.spans = SpanRecorder(self.rank)
        self.profiler = RankProfiler(self.rank, profile, runtime.device)

    # -- set-up ------------------------------------------------------------------------------------
    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return self.programs.groups["trainer"]

    @property
    def is_reporter(self) -> bool:
        return self.rank == self.trainer_ranks[0]

    def _start_engines(self) -> dict[str, GenerationEngine]:
        """One engine per generator role on this rank (the plan's choice), on the role's current weights."""
        max_model_len = self.data_node.spec.prompt_len + self.response_len
        context = EngineContext(self.rank, self.rt.device, self.job.run.threads_per_rank, self.seed, max_model_len,
                                self.plan.hardware.memory_bytes)
        generators = {name for name, role in self.roles.items() if role.placement.kind == "generate"}
        batch: dict[str, int] = {}  # per role, the responses one of its generations on this rank asks for
        for ins in self.programs.rank_stream(self.rank):  # every step splits the batch alike: the first will do
            if isinstance(ins, Generate) and ins.role in generators and ins.role not in batch:
                batch[ins.role] = ins.stop - ins.start
                if len(batch) == len(generators):
                    break
        return {name: build_engine(role.placement, role.module, DTYPES[self.job.models[role.placement.model].dtype],
                                   replace(context, max_batch=batch.get(name, 0)))
                for name, role in self.roles.items() if role.placement.kind == "generate"}

    def _weights_changed(self, role: str) -> None:
        """A generator role's module holds new weights: its engine takes them (a no-op for the native one)."""
        engine = self.engines.get(role)
        if engine is not None:
            engine.weights_updated()

    def _resume(self, saved: dict[str, Any]) -> None:
        """Trained roles' shards and optimizer state, weight versions, and the rollouts this rank had
        received for later steps (an asynchronous schedule's pipeline), from the checkpoint."""
        root = Path(saved["path"])
        for name, info in saved["roles"].items():
            role = self.roles.get(name)
            if role is not None and role.placement.kind == "train":
                assert role.optimizer is not None
                load_role_state(root, name, role.module, role.optimizer, role_group(role, self.rt))
                role.version = int(info["version"])
        for model, versions in saved.get("versions_ahead", {}).items():
            for version in versions:
                self.saved_versions[(model, int(version))] = root / versions_ahead_file(model, int(version))
        same_layout = saved.get("layout") == checkpoint_layout(self.plan)
        self.pieces.update(load_inflight(root, self.rank if same_layout else None, self.rt.device))
        self.restored_steps = frozenset(saved["inflight_steps"])

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Every instruction of this rank's program; raises `RunStopped` after the checkpoint of the step at
        which the trainer ranks agreed to stop on a request."""
        # Every step's Checkpoint, due or not: each is where the trainer ranks agree on a stop request.
        stream = self.programs.ranks[self.rank].instructions(self.programs.steps, every=1)
        self.stop.start_running()
        with self.profiler:
            try:
                for self.index, ins in enumerate(stream):
                    self._release_old_steps(getattr(ins, "step", None))
                    if self.start_step and self._done_before_checkpoint(ins):
                        self._restore_saved_version(ins)
                        continue
                    stop = 0
                    if isinstance(ins, Checkpoint):
                        stop = self.stop.agree(self.rt.group(ins.group), self.rt.comm_device)
                        if not stop and not checkpoint_due(ins.step, self.programs.steps, self.programs.checkpoint_every):
                            continue
                    with self.profiler.at(ins):
                        start = now()
                        self.dispatch[type(ins)](ins)
                        self.spans.record(ins, start, now())
                    if isinstance(ins, TrainStep) and ins.role == self.policy_role and \
                            ins.version in self.versions_for_continuation:
                        kept = full_state_dict(self.roles[ins.role].module, keep=self.is_reporter, to_host=True)
                        # a copy: on a host device the gathered tensors are the live parameters themselves
                        # (a LoRA policy's adapters alone where the generator holds its base, else its
                        # weights with the adapters merged)
                        self.kept_versions[ins.version] = generator_version(
                            {k: v.detach().clone() for k, v in kept.items()},
                            self.job.models[self.roles[ins.role].placement.model].lora)
                    if stop and ins.step < self.programs.steps - 1:  # type: ignore[union-attr]
                        raise RunStopped(stop, ins.step)  # type: ignore[union-attr]
            finally:
                self.spans.write(self.out_dir / "timeline")
                self.metrics.close()
                self.samples.close()
                self.env_errors.close()
        self.write_ledger()

    def _release_old_steps(self, step: int | None) -> None:
        """Drop the rollouts and values (both kept per step, read only by instructions of their step) that
        no later instruction of this rank reads. A trainer rank drops a step's after its last Train; this
        also covers ranks that only generate and send, or only score (a frozen reward or reference
        model), which would otherwise keep every step's data for the whole run."""
        if step is None or step <= self.newest_step:
            return
        self.newest_step = step
        oldest_needed = step - self.data_lag
        for old in [k for k in self.pieces if k < oldest_needed]:
            del self.pieces[old]
        for key in [k for k in self.values if k[0] < oldest_needed]:
            del self.values[key]

    def _done_before_checkpoint(self, ins: Instruction) -> bool:
        """Whether a resumed run skips `ins`: the work of steps before the checkpoint, weight versions
        older than the trainer's (the newest one is synced again, so every copy holds it), and the
        rollouts of later steps the checkpoint already holds (generated ahead, received)."""
        step = getattr(ins, "step", None)
        if step is not None and step < self.start_step:
            return True
        entry = TRAITS[type(ins)]
        if entry.weights == "sets":
            return ins.version < self.start_step  # type: ignore[union-attr]
        return entry.rollout and step in self.restored_steps

    def _versions_a_continuation_reads(self) -> frozenset[int]:
        """The policy's weight versions older than its last one that a longer run's Generate
        instructions after this run's last step may read: none for a synchronous schedule (step i reads
        version i); for an asynchronous one, step i reads a version of at least i - max_staleness, so
        versions steps - max_staleness .. steps - 1 (version 0, the initial weights, every rank rebuilds).
        A short run's programs have no loop body to extend, so the bound, not the programs, decides."""
        if self.job.schedule.mode != "async":
            return frozenset()
        steps = self.programs.steps
        return frozenset(range(max(1, steps - self.job.schedule.max_staleness), steps))

    def _restore_saved_version(self, ins: Instruction) -> None:
        """A resumed run skips the weight syncs of versions before its checkpoint; where a generator here
        still reads one of them (the run resumed was finished, so no rollouts were generated ahead), it
        takes that version's weights from the checkpoint instead of the sync."""
        if TRAITS[type(ins)].weights != "sets":
            return
        path = self.saved_versions.get((ins.model, ins.version))  # type: ignore[union-attr]
        dst = self.roles.get(ins.dst_role)  # type: ignore[union-attr]
        src = self.roles.get(ins.src_role)  # type: ignore[union-attr]
        if path is None or dst is None or (src is not None and dst.module is src.module):
            return
        from safetensors.torch import load_file

        try:
            weights = load_file(str(path))
        except Exception as exc:
            raise self.fail(ins, f"cannot read weight version {ins.version} from {path}: {exc}") from exc  # type: ignore[union-attr]
        if isinstance(dst.module, TensorParallelLlama):
            dst.module.load_full(weights)
        else:  # a LoRA generator's version may be its adapters alone
            dst.module.load_state_dict(weights, strict=not any(map(is_adapter, weights)))
        dst.version = ins.version  # type: ignore[union-attr]
        self._weights_changed(dst.placement.role)

    def write_ledger(self) -> None:
        """This rank's device bytes of weights, gradients and optimizer state, beside the plan's accounting.

        Measured after the last step, when a trained role holds its resting state: its weights (local
        shards under FSDP2), its last gradients, and the optimizer state it keeps (this rank's share
        under ZeRO-1/2/3, float32 master weights and moments for a bf16 model). Compared with the plan's
        state less `gathered` (the unsharded copies FSDP2 holds only while a role computes, reported
        beside it as the planned peak). Not counted on either side: activations, the KV cache, the
        allocator's slack and the Python heap. Generation copies that sample from the trainer's module
        (colocated, `generator_reads_trainer`) count once. An fp8 generator counts its block linears at
        one byte per weight plus their float32 scales (`fp8_state_bytes`), as its placement charges them."""
        modules, optimizers, planned, gathered, fp8_bytes = [], [], 0.0, 0.0, 0
        seen: set[int] = set()
        for role in self.roles.values():  # a trainer whose generator samples from it may end gathered
            if role.wrapping == "fsdp2":
                release_gathered(role.wrapped)  # type: ignore[arg-type]
        for role in self.roles.values():
            if id(role.module) in seen:
                continue
            seen.add(id(role.module))
            modules.append(role.module)
            fp8_bytes += fp8.held_bytes(role.module)[0]
            if role.optimizer is not None:
                optimizers.append(role.optimizer)
            planned += role.placement.memory_bytes.resting_state
            gathered += role.placement.memory_bytes.gathered
        measured = self.rt.device_bytes(modules, optimizers)
        folder = self.out_dir / "ledger"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.rank}.json").write_text(json.dumps({
            "rank": self.rank, "roles": sorted(self.roles), "measured_state_bytes": measured,
            "planned_state_bytes": planned, "planned_peak_state_bytes": planned + gathered,
            "ratio": measured / planned if planned else None, "fp8_state_bytes": fp8_bytes,
            "wrappings": {name: r.wrapping for name, r in sorted(self.roles.items()) if r.placement.kind == "train"},
            "rollout_steps_held": sorted(self.pieces)}))

    def fail(self, ins: Instruction, reason: str) -> RunError:
        return RunError(f"rank {self.rank} instruction {self.index} ({describe(ins)}): {reason}")

    # -- data --------------------------------------------------------------------------------------
    def rollouts(self, step: int, lo: int, hi: int, ins: Instruction) -> dict[str, Tensor]:
        joined, cursor = join_rollouts(self.pieces.get(step, []), lo, hi)
        if joined is None:
            raise self.fail(ins, f"expected rollouts of step {step} for responses [{lo}:{hi}) but holds only up to "
                                 f"{cursor} (a receive is missing)")
        return joined

    def read(self, ins: Instruction, port: str) -> Any:
        node = getattr(ins, "node")
        src = self.nodes[node].inputs.get(port)
        if src is None:
            return None
        if src.op == "generate":
            rollouts = self.rollouts(ins.step, ins.start, ins.stop, ins)  # type: ignore[attr-defined]
            return rollouts[EPISODE_FIELD][:, 0] if src.port == "env_rewards" else rollouts
        key = (ins.step, src.node, src.port)  # type: ignore[attr-defined]
        if key not in self.values:
            raise self.fail(ins, f"input {port} ({src.node}.{src.port}) of step {ins.step} was never computed here")  # type: ignore[attr-defined]
        return self.values[key]

    # -- handlers ----------------------------------------------------------------------------------
    def generate(self, ins: Generate) -> None:
        role = self.roles[ins.role]
        if role.version != ins.version:
            raise self.fail(ins, f"the plan fixes weight version {ins.version} but this rank holds {role.version}")
        self.step_started.setdefault(ins.step, time.perf_counter())
        g = self.group_size
        prompt_ids, prompt_mask = self.source.prompts(ins.step)
        p_lo, p_hi = ins.start // g, ins.stop // g
        prompt_ids = prompt_ids[p_lo:p_hi].repeat_interleave(g, 0).to(self.rt.device)
        prompt_mask = prompt_mask[p_lo:p_hi].repeat_interleave(g, 0).to(self.rt.device)
        spec = self.gen_node.spec
        request = GenerationRequest(prompt_ids, prompt_mask, spec.max_new_tokens, spec.temperature, spec.top_p,
                                    tuple(self.source.stop_ids), self.source.pad_id, self.seed, ins.step, ins.start,
                                    ins.version)
        if role.reads is not None:
            self._check_trainer_weights(ins, role)
        if spec.env is None:
            piece = self.engines[ins.role].generate(request)
        else:
            runner = self._episodes()
            piece = runner.run(self.engines[ins.role], prompt_ids, prompt_mask,
                               episode_rows(self.source, runner.codec, ins.step, ins.start, ins.stop, g),
                               step=ins.step, start=ins.start, version=ins.version, replica=self._replica(role))
            self.env_errors.write(runner.failures)
        self.pieces.setdefault(ins.step, []).append((ins.start, ins.stop, piece))

    def _replica(self, role: RoleState) -> Replica | None:
        """A generator replica of several tp ranks: its group, for episodes run on its first rank."""
        tp = getattr(role.module, "tp", None) if isinstance(role.module, TensorParallelLlama) else \
            getattr(self.engines[role.placement.role], "group", None)
        if tp is None or tp.size == 1:
            return None
        return Replica(tp.group, tp.rank == 0, self.rt.comm_device)

    def _episodes(self) -> EpisodeRunner:
        if self.episodes is None:
            spec, data = self.gen_node.spec, self.data_node.spec
            assert spec.env is not None
            settings = EpisodeSettings(spec.env, spec.max_new_tokens, self.response_len, data.prompt_len,
                                       spec.temperature, spec.top_p, tuple(self.source.stop_ids), self.source.pad_id,
                                       self.seed)
            self.episodes = EpisodeRunner(settings, codec_of(self.source, data))
        return self.episodes

    def _check_trainer_weights(self, ins: Generate, role: RoleState) -> None:
        """A generator that samples from its trainer's module needs the trainer at the generator's version
        and, under FSDP2, its weights whole: gathered by the sync, and gathered again (on every rank of the
        trainer, as each runs this same instruction) if something in between resharded them (a checkpoint
        reads the weights unit by unit)."""
        trainer = self.roles[role.reads]  # type: ignore[index]
        if trainer.version != role.version:
            raise self.fail(ins, f"the generator samples from {trainer.placement.role}'s weights, at version "
                                 f"{trainer.version}, but the plan gives it version {role.version}")
        if trainer.wrapping == "fsdp2":
            gather_in_place(trainer.wrapped)  # type: ignore[arg-type]

    def _forward_role(self, ins: Logprob | Value | Reward) -> RoleState:
        role = self.roles.get(ins.role)
        if role is None:
            raise self.fail(ins, f"role {ins.role} is not placed on this rank")
        return role

    def logprob(self, ins: Logprob) -> None:
        role = self._forward_role(ins)
        r = self.read(ins, "rollouts")
        parts = []
        # Log-probs of the sampling distribution, logits / T, as the generator's behaviour log-probs; a LoRA
        # model's base (the reference it was initialised from) is the model with its adapters off.
        as_base = adapters_off(role.module) if self.bindings.nodes[ins.node].spec.model in self.bindings.bases \
            else nullcontext()
        with torch.no_grad(), sampling_temperature(role.module, self.gen_node.spec.temperature), as_base:
            replays = self.router_replay == "R3" and role.placement.model == self.policy_role and ROUTES_FIELD in r
            for rows in self._micro_batches(role, r):
                b = {k: r[k][rows] for k in training.ROW_FIELDS}
                routes = r[ROUTES_FIELD][rows] if replays else None
                if role.wrapped is not None:  # trained (DDP / FSDP2) or tensor-parallel: through its wrapper
                    lp, _ = role.wrapped(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"],
                                         routes=routes)
                else:
                    lp, _ = token_logprobs_and_entropy(role.module, b["prompt_ids"], b["prompt_mask"],
                                                       b["response_ids"], b["response_mask"], pack=self.pack,
                                                       routes=routes)
                parts.append(lp.float())
        self.values[(ins.step, ins.node, "logprobs")] = torch.cat(parts) * training.loss_mask(r)

    def value(self, ins: Value) -> None:
        role = self._forward_role(ins)
        r = self.read(ins, "rollouts")
        parts = []
        with torch.no_grad():
            for rows in self._micro_batches(role, r):
                b = {k: r[k][rows] for k in training.ROW_FIELDS}
                if role.wrapped is not None:
                    values = role.wrapped(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
                else:
                    values = token_values(role.module, b["prompt_ids"], b["prompt_mask"], b["response_ids"],
                                          b["response_mask"], pack=self.pack)
                parts.append(values.float())
        self.values[(ins.step, ins.node, "values")] = torch.cat(parts) * training.loss_mask(r)

    def _micro_batches(self, role: RoleState, r: dict[str, Tensor]) -> list[slice]:
        """The micro-batches of `role`'s forwards on these rows. Ranks whose forwards run collectives
        together on different rows agree on their count: a trained role's data-parallel group, and that of
        a frozen model sharded over it (FSDP layers), where packed sequences make the counts differ."""
        p = role.placement
        sharded = p.kind == "train" or (p.kind == "infer" and (p.sharding == "fsdp" or p.tp > 1))
        group = self._data_parallel_group(role) if sharded else None
        return training.micro_batches(r, self.job.algorithm, group, self.rt)

    def reward(self, ins: Reward) -> None:
        r = self.read(ins, "rollouts")
        spec = self.nodes[ins.node].spec
        # Text only where it is read: every response for answer rules, the step's samples otherwise.
        responses = self.source.decode(r["response_ids"], self._answer_mask(r)) if spec.rules else None
        answers = self._answers(ins)
        if spec.rules:
            assert answers is not None and responses is not None  # typecheck: answer rules need a file dataset
            try:
                rewards = torch.tensor(combined_reward(spec.rules, responses, answers), dtype=torch.float32)
            except RewardRuleError as exc:
                prompt = self.source.decode(r["prompt_ids"][exc.index:exc.index + 1],
                                            r["prompt_mask"][exc.index:exc.index + 1])[0]
                raise self.fail(ins, f"reward node {ins.node!r}: {exc} of step {ins.step}, rollout {ins.start + exc.index}; "
                                     f"prompt {prompt!r}") from exc
        elif spec.fn is not None:
            fn = resolve_callable(spec.fn, REWARDS, "reward function")
            try:  # the user's code: its exception names the node, the function and the step
                result = fn(r["prompt_ids"], r["prompt_mask"], r["response_ids"], training.loss_mask(r))
            except Exception as exc:
                reason = (str(exc).strip().splitlines() or [""])[0][:200]
                raise RunError(f"step {ins.step}: reward node {ins.node!r}: function {spec.fn!r} raised "
                               f"{type(exc).__name__}: {reason}",
                               fix=f"fix the reward function {spec.fn} (it was scoring rollouts "
                                   f"[{ins.start}:{ins.stop}) of step {ins.step})") from exc
            try:
                rewards = reward_tensor(result, ins.stop - ins.start, f"reward node {ins.node!r}: function {spec.fn!r}")
            except RunError as exc:
                raise RunError(f"step {ins.step}: {exc.message}", fix=exc.fix) from None
        else:
            role = self._forward_role(ins)
            with torch.no_grad():
                values = token_values(role.module, r["prompt_ids"], r["prompt_mask"], r["response_ids"],
                                      r["response_mask"], pack=self.pack)
            last = (r["response_mask"].long().sum(1) - 1).clamp(min=0)
            rewards = values.gather(1, last[:, None]).squeeze(1).float()
        if rewards.shape != (ins.stop - ins.start,):
            raise self.fail(ins, f"reward function returned shape {tuple(rewards.shape)}, expected ({ins.stop - ins.start},)")
        env_rewards = self.read(ins, "env_rewards")
        if env_rewards is not None:
            rewards = rewards + env_rewards.to(rewards)
        made_by = f"rules {', '.join(spec.rules)}" if spec.rules else f"function {spec.fn!r}" if spec.fn else \
            f"reward model {spec.model!r}"
        check_rewards(rewards, f"reward node {ins.node!r} ({made_by})", ins.step, ins.start,
                      lambda i: self.source.decode(r["prompt_ids"][i:i + 1], r["prompt_mask"][i:i + 1])[0])
        self.values[(ins.step, ins.node, "rewards")] = rewards
        self._scored(ins, r, rewards, answers, responses)

    def _answers(self, ins: Reward | Advantage) -> list[str] | None:
        """The dataset's answer of each response [start, stop) of the step (None for a task dataset)."""
        examples = self.source.examples(ins.step)
        return None if examples is None else [examples[i // self.group_size].answer for i in range(ins.start, ins.stop)]

    def _answer_mask(self, r: dict[str, Tensor]) -> Tensor:
        """The tokens an answer rule reads: the response, or an episode's last model turn."""
        return r["response_mask"] if LOSS_MASK_FIELD not in r else last_turn_mask(r[LOSS_MASK_FIELD])

    def _scored(self, ins: Reward | Advantage, r: dict[str, Tensor], rewards: Tensor, answers: list[str] | None,
                responses: list[str] | None = None) -> None:
        """A step's rewards of responses [start, stop): counted for the step's metrics, and the first responses
        of each step written to samples.jsonl (once, whichever rank scores them; `responses`: their text, where
        an answer rule decoded it already)."""
        if ins.start == 0:
            n = min(self.samples.per_step, ins.stop - ins.start)
            prompts = self.source.decode(r["prompt_ids"][:n], r["prompt_mask"][:n])
            shown = responses[:n] if responses is not None else self.source.decode(r["response_ids"][:n],
                                                                                    self._answer_mask(r)[:n])
            self.samples.write(ins.step, int(r["version"].item()), prompts, shown, rewards[:n].tolist(),
                               training.loss_mask(r)[:n].sum(1).tolist(), None if answers is None else answers[:n],
                               episode_samples(self.source, r, n) if EPISODE_FIELD in r else None)
        stats = self.stats.setdefault(ins.step, StepStats())
        stats.reward_sum += float(rewards.sum())
        stats.reward_count += rewards.numel()

    def advantage(self, ins: Advantage) -> None:
        spec = self.nodes[ins.node].spec
        a = self.job.algorithm
        rewards = self.read(ins, "rewards")
        r = self.read(ins, "rollouts")
        if self.nodes[ins.node].inputs["rewards"].op == "generate":  # an environment's rewards, taken directly
            self._scored(ins, r, rewards, self._answers(ins))
        values = self.read(ins, "values") if ESTIMATORS[spec.estimator].needs_values else None
        kl = None
        if a.kl_in == "reward" and a.kl_coef > 0:  # typecheck: the node reads the reference's log-probs
            old = self.read(ins, "old_logprobs")
            sampling = old if old is not None else r["behaviour_logprobs"]
            kl = alg.kl_terms(sampling, self.read(ins, "ref_logprobs"), a.kl_estimator)
        policy = self.roles.get(self.policy_role)
        group = self._data_parallel_group(policy) if policy is not None and policy.placement.kind == "train" else None
        mask = training.loss_mask(r)
        inputs = alg.AdvantageInputs(rewards, mask, values, self.group_size, spec, kl=kl,
                                     kl_coef=a.kl_coef, batch_sum=lambda x: training.batch_sum(x, group, self.rt))
        adv, returns = alg.ADVANTAGE_FNS[spec.estimator](inputs)
        out = {"advantages": adv.float(), "returns": returns.float()}
        if kl is not None:  # reported by the policy's train step as its `kl` metric
            out["kl"] = torch.where(mask, kl.float(), 0.0)
        self.values[(ins.step, ins.node, "advantages")] = out

    def train_step(self, ins: TrainStep) -> None:
        role = self.roles[ins.role]
        if role.version != ins.version - 1:
            raise self.fail(ins, f"expected to update version {ins.version - 1} but holds {role.version}")
        if role.offloaded:
            raise self.fail(ins, f"{ins.role}'s {', '.join(sorted(role.offloaded))} are offloaded; an Onload is missing")
        loss = self.nodes[ins.node].spec.loss
        critic = LOSSES[loss].trains == "critic"
        r = self.read(ins, "rollouts")
        metrics = training.update(
            role, loss, self.job.algorithm, r, self.read(ins, "advantages"),
            self.read(ins, "values") if critic else self.read(ins, "old_logprobs"),
            None if critic else self.read(ins, "ref_logprobs"), temperature=self.gen_node.spec.temperature,
            group=self._data_parallel_group(role), rt=self.rt, node=ins.node, step=ins.step)
        role.version = ins.version
        if ins.role == self.policy_role:
            self._report(ins, r, metrics)
        if ins.node == self.last_train_node:  # the step's data is no longer needed
            for key in [k for k in self.values if k[0] <= ins.step]:
                del self.values[key]
            for step in [k for k in self.pieces if k <= ins.step]:
                del self.pieces[step]

    def _data_parallel_group(self, role: RoleState) -> Any:
        return training.data_parallel_group(role, self.mesh_groups, self.rt)

    def _report(self, ins: TrainStep, r: dict[str, Tensor], metrics: dict[str, float]) -> None:
        """All-reduce the step's figures over the trainer group and let its first rank write them."""
        stats = self.stats.pop(ins.step, StepStats())
        names = sorted(metrics)
        lengths = training.loss_mask(r).sum(1)
        episodes = episode_sums(r[EPISODE_FIELD]) if EPISODE_FIELD in r else {}
        # on the device the trainer group's backend reduces (NCCL: the GPU)
        local = torch.tensor([stats.reward_sum, stats.reward_count, float(lengths.sum()), lengths.numel()]
                             + [metrics[k] for k in names] + list(episodes.values()), dtype=torch.float64,
                             device=self.rt.comm_device)
        longest = torch.tensor([int(lengths.max()) if lengths.numel() else 0], dtype=torch.int64,
                               device=self.rt.comm_device)
        group = self.rt.group("trainer")
        if group is not None:
            dist.all_reduce(local, group=group)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        n_ranks = len(self.trainer_ranks)
        now = time.perf_counter()
        step_time = now - self.last_train_end
        self.last_train_end = now
        if self.is_reporter:
            row = {
                "step": ins.step,
                "reward_mean": float(local[0] / max(local[1], 1)),
                **{k: float(local[4 + i] / n_ranks) for i, k in enumerate(names)},
                "step_time_s": step_time,
                # the tp ranks of a data shard each count its tokens
                "tokens_per_s": float(local[2]) / self.roles[ins.role].placement.tp / step_time if step_time > 0 else 0.0,
                "weight_version": int(r["version"].item()),
                # the tp ranks of a data shard each count its responses and tokens alike: the mean is the batch's
                "response_tokens_mean": float(local[2] / max(local[3], 1)),
                "response_tokens_max": int(longest.item()),
            }
            row.setdefault("kl", 0.0)
            if episodes:  # summed over the trainer group: its tp ranks each hold a data shard's episodes
                sums = local[4 + len(names):] / self.roles[ins.role].placement.tp
                replicas = next(p.dp for p in self.plan.chosen.placements if p.kind == "generate")
                row.update(episode_metrics(dict(zip(episodes, sums.tolist())), replicas))
            self.metrics.write(row)

    def send(self, ins: Send) -> None:
        send_piece(self.rt, self._piece_for(ins), ins.peer)

    def recv(self, ins: Recv) -> None:
        piece = recv_piece(self.rt, ins.peer, ins.stop - ins.start, self.data_node.spec.prompt_len,
                           self.response_len, self.source.pad_id, self.route_width, self.episode_width)
        self.pieces.setdefault(ins.step, []).append((ins.start, ins.stop, piece))

    def _piece_for(self, ins: Send) -> dict[str, Tensor]:
        for a, b, data in self.pieces.get(ins.step, []):
            if a <= ins.start and ins.stop <= b:
                take = slice(ins.start - a, ins.stop - a)
                return {k: (v if k == "version" else v[take]).contiguous() for k, v in data.items()}
        raise self.fail(ins, f"has no rollouts [{ins.start}:{ins.stop}) of step {ins.step} to send")

    def offload(self, ins: Offload) -> None:
        self.rt.move_state(self.roles[ins.role], ins.state, to_host=True)
        self.roles[ins.role].offloaded |= set(ins.state)

    def onload(self, ins: Onload) -> None:
        self.rt.move_state(self.roles[ins.role], ins.state, to_host=False)
        self.roles[ins.role].offloaded -= set(ins.state)

    def _sync_record(self, model: str) -> WeightSyncRecord:
        """The DDMA plan of `model`'s colocated reshard into a tensor-parallel generator, as the plan stores it."""
        record = next((r for r in self.programs.weight_syncs.values() if r.model == model), None)
        if record is None:
            raise RunError(f"the plan holds no weight-sync plan to fill the tensor-parallel generator of {model}",
                           fix="compile the job again with this graphrl")
        return record

    def weight_sync(self, ins: WeightSync) -> None:
        data = self.programs.weight_syncs[ins.transfer]
        src_role = self.roles.get(ins.src_role)
        dst_role = self.roles.get(ins.dst_role)
        if src_role is not None and src_role.placement.kind == "train" and src_role.version != ins.version:
            raise self.fail(ins, f"trainer holds version {src_role.version}, the plan syncs {ins.version}")
        src = src_role.module if src_role and src_role.placement.kind == "train" else None
        lora = self.job.models[ins.model].lora
        run_weight_sync(data, self.rank, src, dst_role.module if dst_role else None, self.rt,
                        merge=lora is not None and lora.merged)
        if lora is not None:  # the adapters moved, alone or merged: check the generator samples with them
            check_delivery(data, self.rank, src, dst_role.module if dst_role else None, ins.version, self.rt,
                           src_wrapped=src_role.wrapped if src is not None else None)  # type: ignore[union-attr]
        if dst_role is not None:
            dst_role.version = ins.version
            self._weights_changed(ins.dst_role)

    def reshard_in_place(self, ins: ReshardInPlace) -> None:
        src, dst = self.roles[ins.src_role], self.roles[ins.dst_role]
        if src.version != ins.version:
            raise self.fail(ins, f"trainer holds version {src.version}, generation needs {ins.version}")
        lora = self.job.models[ins.model].lora
        if isinstance(dst.module, TensorParallelLlama):  # each rank fills its shards; none gathers the model
            run_weight_sync(self._sync_record(ins.model), self.rank, src.module, dst.module, self.rt,
                            merge=lora is not None and lora.merged)
        elif dst.reads is not None:  # the generator samples from the trainer's weights: whole, or gathered here
            if src.wrapping == "fsdp2":
                gather_in_place(src.wrapped)  # type: ignore[arg-type]
        elif fp8.is_quantized(dst.module):  # quantized here, tensor by tensor, from the trainer's weights
            fp8.copy_quantized(dst.module, src.module, src.wrapped)
        elif dst.module is not src.module:
            copy_full_weights(dst.module, src.module, src.wrapped)
        if dst.reads is None and lora is not None:  # a copy of its own: check it
            problem = probe_mismatch(dst.module, probe_logprobs(src.module, src.wrapped))
            if problem is not None:
                raise self.fail(ins, f"after the reshard to version {ins.version}, {problem}")
        dst.version = ins.version
        self._weights_changed(ins.dst_role)

    def release_weights(self, ins: ReleaseWeights) -> None:
        """Nothing to free: a colocated generator that samples from the trainer's module leaves its weights to
        the trainer (FSDP2 keeps them gathered through the next backward, as the plan charges that trainer),
        and a copy of its own is refilled in place by the next sync."""

    def checkpoint(self, ins: Checkpoint) -> None:
        """Every trainer rank writes its shards of the trained roles and the rollouts it already holds for
        later steps; the reporting rank adds the full weights and moves the folder into place."""
        roles = {name: r for name, r in self.roles.items() if r.placement.kind == "train"}
        last = ins.step == self.programs.steps - 1
        write_checkpoint(self.out_dir, ins.step, roles, self.rt, self.rt.group(ins.group), self.job,
                         reporter=self.is_reporter,
                         inflight={step: held for step, held in self.pieces.items() if step > ins.step},
                         layout=checkpoint_layout(self.plan),
                         versions_ahead={self.policy_role: self.kept_versions} if last and self.kept_versions else {})


# One handler per instruction kind: the executor's part of each kind's meaning (`schemas.program.TRAITS`
# holds the part every reader of a program shares; `compiler/semantics.py` the simulator's and verify's).
HANDLERS: dict[type, Callable[..., None]] = {
    Generate: RankExecutor.generate,
    Logprob: RankExecutor.logprob,
    Value: RankExecutor.value,
    Reward: RankExecutor.reward,
    Advantage: RankExecutor.advantage,
    TrainStep: RankExecutor.train_step,
    Send: RankExecutor.send,
    Recv: RankExecutor.recv,
    Offload: RankExecutor.offload,
    Onload: RankExecutor.onload,
    WeightSync: RankExecutor.weight_sync,
    ReshardInPlace: RankExecutor.reshard_in_place,
    ReleaseWeights: RankExecutor.release_weights,
    Checkpoint: RankExecutor.checkpoint,
}


def run_rank(plan: Plan, runtime: Runtime, out_dir: Path, start_step: int = 0,
             resume_state: dict[str, Any] | None = None, profile: ProfileSettings | None = None,
             stop: StopRequests | None = None) -> None:
    RankExecutor(plan, runtime, out_dir, start_step=start_step, resume_state=resume_state, profile=profile,
                 stop=stop).run()


__all__ = ["RankExecutor", "join_rollouts", "run_rank"]
