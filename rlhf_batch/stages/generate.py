"""generate: G samples per prompt with the iteration's policy, into iter=K/rollouts.

Rows are decoded in batches of similar prompt length (left-padded, KV cache). Finished rows
leave the batch and its cache, so they stop costing compute. Each row draws its randomness
from its own generator, seeded by (seed, rollout_id): a rollout does not depend on which other
rows shared its batch (up to the floating-point effects of batch shape). The behaviour log-prob
of each sampled token is log_softmax(logits / temperature) over the full vocabulary in float32
(before top-k / top-p filtering), the same definition score and train use. With
generate.engine = "vllm", vLLM samples the rows instead (VLLMEngine), under the same definitions.

Ends and special tokens: a row stops on every end token the model declares (the tokenizer's
EOS, each id of `generation_config.eos_token_id`, which may be a list, and the token a chat
template closes an assistant turn with, e.g. `<|im_end|>`). The pad token is never sampled
(unless it is also a stop token): it is filtered out like top-k, the log-prob keeps the full
vocabulary. `response` is the text the model wrote with special tokens kept (`<|unk|>`,
`<|im_start|>`, ...), only the final stop token left out, so a reward function sees them; the
manifest counts the rollouts holding one (`with_special_tokens`).

Prompt batches: with `generate.prompts_per_iteration` > 0 iteration K takes its batch of a
per-epoch seeded shuffle of the prompt set (core/prompt_batches.py), a top-up round the next
batch of the same order (topup.py); the manifest records the batch index, the epoch and the
positions (`prompt_batch`). A weighted mixture (`generate.prompts = [{path, weight}, ...]`) takes
seeded quotas of each source (data/mixtures.py); `generate.prompt_filter` then skips the batch's
prompts whose pass rate over earlier iterations fails it (data/curriculum.py).

Staleness: with `max_staleness = S` iteration K (each of its top-up rounds too) samples from the
policy train of iteration K - 1 - S wrote, the initial policy while that is negative
(models/policy.sampling_policy). The `policy` column names it; the manifest records
`policy_iteration` (-1: the initial policy) and `staleness` = min(S, K), 0 in lock-step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.data import curriculum, topup
from rlhf_batch.data.mixtures import identity as mixture_identity
from rlhf_batch.data.mixtures import is_mixture
from rlhf_batch.data.prompt_files import fingerprint as prompt_fingerprint
from rlhf_batch.data.prompts import Prompts, load_prompts
from rlhf_batch.engines import engine_version, make_engine
from rlhf_batch.engines.base import Engine, special_ids
from rlhf_batch.errors import StageError
from rlhf_batch.models.policy import sampled_by, sampling_policy
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.store import layout
from rlhf_batch.store.ids import rollout_id, row_seed
from rlhf_batch.store.schemas import ROLLOUTS, with_extra


class Generate(Stage):
    name, folder, unit = "generate", layout.ROLLOUTS, "rollout"

    def __init__(self, cfg: Config, iteration: int, topup: int = 0):
        super().__init__(cfg, iteration, topup)
        self.policy: str  # prepare(): the policy it samples from (max_staleness iterations back)
        self.batch: int  # prepare(): the batch of the prompt order it takes
        self.tok: Any  # plan(): the policy's tokenizer
        self.prompts: Prompts  # plan(): the batch's prompts
        self.order: list[int]  # plan(): the prompts in the order parts take them
        self.engine: Engine  # open(): what samples

    def prepare(self) -> None:
        from rlhf_batch.store.modeldir import model_fingerprint

        if self.cfg.demo:
            from rlhf_batch.data.demo import ensure_demo_assets

            ensure_demo_assets(self.cfg)
        self.policy = sampling_policy(self.cfg, self.iteration)  # max_staleness iterations back
        self.batch = topup.batch_index(self.cfg, self.iteration, self.topup)
        self.fingerprints = {
            "prompts": prompt_fingerprint(self.cfg.generate.prompts),
            "policy": model_fingerprint(self.policy, "policy"),
            "iteration": self.iteration,
            **({"topup": self.topup} if self.topup else {}),
            # the batch of the prompt order this round takes, when top-up rounds moved it off the
            # iteration's (topup.py; left out otherwise, so the identities of runs without them stay)
            **({"prompt_batch": self.batch} if self.batch != self.iteration else {}),
            # a weighted mixture's names and weights (mixtures.py; the files are in `prompts`)
            **(
                {"mixture": mixture_identity(self.cfg.generate.prompts)}
                if is_mixture(self.cfg.generate.prompts)
                else {}
            ),
            # generate.prompt_filter (curriculum.py): the filter and its history; off: left out
            **(
                {"prompt_filter": curriculum.inputs(self.cfg, self.iteration)}
                if curriculum.enabled(self.cfg)
                else {}
            ),
        }

    def check(self) -> None:
        """The start policy can be loaded (not removed by keep_policies); a top-up round must come
        before the next iteration takes its prompts: that iteration started after the batches
        taken so far, this round's included."""
        from rlhf_batch.models.lora import check_targets
        from rlhf_batch.store.modeldir import check_model_dir

        check_model_dir(self.policy, "policy")
        check_targets(self.cfg)
        if self.cfg.generate.environment:
            from rlhf_batch.stages.multiturn import environment_factory

            environment_factory(self.cfg, self.cfg.generate.environment)  # a bad name: before any write
        nxt = layout.folder(self.cfg.run_dir, self.iteration + 1, layout.ROLLOUTS)
        if self.topup and self.cfg.generate.prompts_per_iteration and nxt.exists():
            raise StageError(
                f"{nxt}: iteration {self.iteration + 1} has started; top-up round {self.topup} of "
                f"iteration {self.iteration} would take prompts of the order it went on from"
            )

    def plan(self) -> int:
        from rlhf_batch.models.load import load_tokenizer

        self.tok = load_tokenizer(self.policy, self.cfg.trust_remote_code)
        self.prompts = load_prompts(self.cfg.generate, self.tok, self.batch, self.cfg.seed)
        self.filtered: dict[str, Any] = {}
        if curriculum.enabled(self.cfg):
            self.prompts, self.filtered = curriculum.apply(
                self.cfg,
                self.iteration,
                self.prompts,
                lambda k: load_prompts(self.cfg.generate, self.tok, k, self.cfg.seed),
            )
        self.order = list(range(len(self.prompts.ids)))
        return math.ceil(len(self.order) / self.cfg.generate.prompts_per_part)

    def progress_total(self, todo: list[int]) -> int:
        """The rollouts these parts will hold (the last part may hold fewer prompts)."""
        g, n_prompts = self.cfg.generate, len(self.order)
        return (
            sum(min(g.prompts_per_part, n_prompts - n * g.prompts_per_part) for n in todo) * g.num_generations
        )

    def open(self, todo: list[int]) -> None:
        self.engine = make_engine(self.cfg, self.policy, self.tok, self.prompts)
        g = self.cfg.generate
        if g.environment:
            from rlhf_batch.stages.multiturn import open_pool

            self.pool = open_pool(self.cfg, g)

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()
            del self.pool

    def on_complete(self) -> None:
        if self.cfg.generate.environment:
            from rlhf_batch.stages.multiturn import drop_checkpoints

            drop_checkpoints(self.sdir)

    def write_parts(self, todo: list[int], out: Any, bar: Any) -> None:
        """Part by part; an engine that samples best all at once (`one_call`: vllm) gets every
        part's rows in one call first, and the parts are then written and committed one by one.
        With an environment, part by part turn by turn (multiturn.py) whatever the engine."""
        if self.cfg.generate.environment:
            from rlhf_batch.stages.multiturn import write_turn_parts

            return write_turn_parts(self, todo, out, bar)
        if not todo or not getattr(self.engine, "one_call", False):  # no part left: no engine opened
            return super().write_parts(todo, out, bar)
        first = topup.sample_offset(self.cfg, self.topup)
        plans = [part_rows(self.prompts, n, self.cfg, self.iteration, self.order, first) for n in todo]
        prompts = [p for plan in plans for p in plan.prompts]
        results = self.engine.sample(prompts, [s for plan in plans for s in plan.seeds], bar)
        start = 0
        for n, plan in zip(todo, plans, strict=True):
            mine, start = results[start : start + len(plan.rows)], start + len(plan.rows)
            table = part_table(plan, mine, self.tok, self.prompts, n, self.cfg, self.policy)
            out.write(n, self.part(table))
        return None

    def write_part(self, n: int, bar: Any) -> Part:
        table = generate_part(
            self.engine,
            self.tok,
            self.prompts,
            n,
            self.cfg,
            self.iteration,
            self.policy,
            bar,
            self.order,
            topup.sample_offset(self.cfg, self.topup),
            getattr(self, "pool", None),
            self.sdir,
        )
        return self.part(table)

    def part(self, table: pa.Table) -> Part:
        schema = with_extra(ROLLOUTS, self.prompts.carried.schema)
        if self.cfg.generate.environment:
            schema = with_extra(schema, _turn_schema(table, schema))
        counts = {"rollouts": table.num_rows, "with_special_tokens": _with_special(table, self.tok)}
        if self.cfg.generate.environment:
            counts |= _turn_counts(table)
            counts[DROPPED] = int((table.schema.metadata or {}).get(DROPPED.encode(), 0))
        return Part(table, schema, counts, list_tokens(table, "prompt_ids", "response_ids"))

    def manifest_extra(self) -> dict[str, Any]:
        extra = {
            "prompt_counts": self.prompts.counts,
            "policy": self.policy,
            **sampled_by(self.cfg, self.iteration),
            "prompt_batch": self.prompts.batch,
            "engine": self.cfg.generate.engine,
            "engine_version": engine_version(self.cfg.generate.engine),
            **({"prompt_filter": self.filtered} if self.filtered else {}),
        }
        return {**extra, "topup": self.topup, "prompts_sampled": len(self.order)} if self.topup else extra


def generate_part(
    engine: Engine,
    tok: Any,
    prompts: Prompts,
    n: int,
    cfg: Config,
    iteration: int,
    policy: str,
    bar: Any,
    order: list[int] | None = None,
    first_sample: int = 0,
    pool: Any = None,
    where: Any = None,
) -> pa.Table:
    """All rollouts of the prompts in part n (of `order`, default every prompt in file order), in
    (prompt, sample) order; sample indices start at `first_sample` (a top-up round's). With
    `cfg.generate.environment`: trajectories, turn by turn with the environments of `pool`
    (envs/pool.py), each turn committed to the turn checkpoint in the stage folder `where`."""
    plan = part_rows(prompts, n, cfg, iteration, order, first_sample)
    if cfg.generate.environment:
        return _multi_turn_part(engine, pool, tok, prompts, plan, n, cfg, policy, bar, where)
    results = engine.sample(plan.prompts, plan.seeds, bar)
    return part_table(plan, results, tok, prompts, n, cfg, policy)


def _multi_turn_part(
    engine: Engine,
    pool: Any,
    tok: Any,
    prompts: Prompts,
    plan: PartRows,
    n: int,
    cfg: Config,
    policy: str,
    bar: Any,
    where: Any,
) -> pa.Table:
    """Part n's trajectories, turn by turn with the environment (stages/multiturn.py): the
    rollouts columns, then the trajectory columns and the environment's reward parts."""
    from rlhf_batch.data import chat_turns
    from rlhf_batch.stages import multiturn
    from rlhf_batch.store.schemas import TURN_TEXTS

    carried = prompts.carried.take(pa.array([i for i, _ in plan.rows], pa.int64())).to_pylist()
    rows = [env_row(c, prompts, i) for c, (i, _) in zip(carried, plan.rows, strict=True)]
    trajs = multiturn.sample_part(engine, pool, tok, cfg, plan, rows, where, n)
    results = [(t.ids, t.logps, t.finish) for t in trajs]
    table = part_table(plan, results, tok, prompts, n, cfg, policy)
    for name, col in multiturn.turn_columns(trajs).items():
        table = table.append_column(name, col)
    texts = [chat_turns.segment_texts(tok, t.ids, t.starts) for t in trajs]  # the turns view's text
    table = table.append_column("turn_texts", pa.array(texts, TURN_TEXTS))
    bar.update(len(trajs))
    dropped = sum(t.dropped for t in trajs)  # the manifest's count (Generate.part)
    return table.replace_schema_metadata({DROPPED: str(dropped)})


DROPPED = "dropped_observations"


def env_row(carried: dict[str, Any], prompts: Prompts, i: int) -> dict[str, Any]:
    """What an environment factory gets for prompt i: the prompt file's columns under their own
    names (its id and chat columns too), `prompt_id` and `prompt` (the rendered text)."""
    row = {**carried, "prompt_id": prompts.ids[i], "prompt": prompts.texts[i]}
    if prompts.id_column:
        row.setdefault(prompts.id_column, prompts.ids[i])
    if prompts.chat_column:
        row.setdefault(prompts.chat_column, carried.get("prompt_messages"))
    return row


@dataclass
class PartRows:
    """The rows of one part: (prompt index, sample index), their rollout ids, prompts and seeds."""

    rows: list[tuple[int, int]]
    rids: list[str]
    prompts: list[list[int]]
    seeds: list[int]


def part_rows(
    prompts: Prompts, n: int, cfg: Config, iteration: int, order: list[int] | None, first_sample: int
) -> PartRows:
    g = cfg.generate
    order = list(range(len(prompts.ids))) if order is None else order
    idx = order[n * g.prompts_per_part : (n + 1) * g.prompts_per_part]
    rows = [(i, s) for i in idx for s in range(first_sample, first_sample + g.num_generations)]
    rids = [rollout_id(iteration, prompts.ids[i], s) for i, s in rows]
    return PartRows(rows, rids, [prompts.tokens[i] for i, _ in rows], [row_seed(cfg.seed, r) for r in rids])


def part_table(
    plan: PartRows, results: list[Any], tok: Any, prompts: Prompts, n: int, cfg: Config, policy: str
) -> pa.Table:
    """The rollouts table of one part from its engine results (one per row, in row order)."""
    rows, rids = plan.rows, plan.rids
    for rid, (_, logps, _) in zip(rids, results, strict=True):
        if not all(map(math.isfinite, logps)):
            raise StageError(
                f"{policy}: non-finite behaviour log-prob in rollout {rid} (the model's "
                f"logits overflow in {cfg.dtype}?); nothing of part {n} was written"
            )
    columns = {
        "rollout_id": rids,
        "prompt_id": [prompts.ids[i] for i, _ in rows],
        "sample_idx": [s for _, s in rows],
        "prompt": [prompts.texts[i] for i, _ in rows],
        "prompt_ids": [prompts.tokens[i] for i, _ in rows],
        # special tokens kept; a row that stopped ends with its stop token, left out of the text
        "response": tok.batch_decode(
            [r[0][:-1] if r[2] == "stop" else r[0] for r in results], skip_special_tokens=False
        ),
        "response_ids": [r[0] for r in results],
        "behavior_logprobs": [r[1] for r in results],
        "finish_reason": [r[2] for r in results],
        "policy": [layout.in_run(policy, cfg.run_dir)] * len(rows),  # relative inside the run
    }
    table = pa.table({k: pa.array(v, ROLLOUTS.field(k).type) for k, v in columns.items()})
    carried = prompts.carried.take(pa.array([i for i, _ in rows], pa.int64()))
    for name in carried.column_names:
        table = table.append_column(carried.schema.field(name), carried.column(name))
    return table


def _turn_schema(table: pa.Table, base: pa.Schema) -> pa.Schema:
    """The multi-turn columns after `base`: TURNS, then the environment's reward parts."""
    return pa.schema([table.schema.field(n) for n in table.column_names if n not in base.names])


def _turn_counts(table: pa.Table) -> dict[str, int]:
    """The manifest's counts of a multi-turn part."""
    import pyarrow.compute as pc

    return {
        "turns": int(pc.sum(table["turns"]).as_py() or 0),
        "env_errors": table.num_rows - table["env_error"].null_count,
        "truncated": int(pc.sum(pc.equal(table["finish_reason"], "length")).as_py() or 0),
        "env_milliseconds": int(1000 * (pc.sum(table["env_seconds"]).as_py() or 0.0)),
    }


def _with_special(table: pa.Table, tok: Any) -> int:
    """Rollouts whose response holds a special token before its final stop token (a row that
    finished with 'stop' ends with the token that stopped it)."""
    special = special_ids(tok)
    n = 0
    ids_col, reasons = table.column("response_ids").to_pylist(), table.column("finish_reason").to_pylist()
    for ids, reason in zip(ids_col, reasons, strict=True):
        body = ids[:-1] if reason == "stop" else ids
        n += any(i in special for i in body)
    return n
