"""eval: held-out evaluation of the policy iteration K starts from, into iter=K/eval.

`eval.n` samples per prompt of `[eval] prompts` (read as generate reads prompts: the same
prompt/messages/id columns and max_prompt_tokens) are drawn with generate's engine and
`generate_part`, with eval's own temperature, top_p, top_k and max_new_tokens, and scored with
score's reward-calling code (`eval.reward_functions`, default `score.reward_functions` and their
weights). No KL, no clipping, no reward model: `reward` is the weighted sum of the functions.
With `generate.environment` set, the samples are trajectories sampled turn by turn with the
environment (generate's turn loop, stages/multiturn.py, its checkpoints in eval's folder); the
reward functions may read the environment's `env_<name>` reward parts, checked at each part.

A sample is *correct* when the value of one reward function, `eval.correct_function` (default:
the first), is >= `eval.correct_threshold` (default 1.0: a 0/1 verifiable reward is correct when
it is 1); the other functions (a length penalty) change mean@n and best@n, not correctness. Rows are the rollouts columns plus `reward_<fn>` per function,
`reward` and `correct`. Rows draw their random numbers from a seed stream of eval's own
(`row_seed(seed, "eval")` in place of `seed`), so a held-out prompt that is also a training
prompt does not repeat generate's samples. The manifest's `metrics` holds, per data source (the prompt set's
`data_source` column, else one source "all"), mean@n, best@n and pass@k for each k in `eval.k`
(rlhf_batch.core.eval_metrics: the unbiased estimator 1 - C(n-c, k) / C(n, k)) and `prompts`;
`overall` the same over every prompt. A prompt with a sample that a function could not score
(None) is left out of the metrics and counted as `prompts_unscored`.

Iteration K evaluates the policy iteration K starts from (stages.base.start_policy), so the
policy the last of N iterations trained is evaluated at K = N. `run` evaluates iteration 0,
every `eval.every`-th and N when `[eval] prompts` is set (`Eval.runs_at`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rlhf_batch.config import Config, GenerateConfig, reward_search_path
from rlhf_batch.core.eval_metrics import aggregate, aggregate_by_source, group_samples
from rlhf_batch.data.prompt_files import describe
from rlhf_batch.data.prompt_files import fingerprint as prompt_fingerprint
from rlhf_batch.data.prompts import Prompts, load_prompts
from rlhf_batch.engines import make_engine
from rlhf_batch.engines.base import Engine
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.models.policy import start_policy
from rlhf_batch.rewards import RewardFunction, load_reward_functions, strip_alias, weighted_sum
from rlhf_batch.rewards.cache import RewardCalls
from rlhf_batch.rewards.conventions import check_arguments
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.stages.generate import generate_part
from rlhf_batch.stages.score.scorer import reward_values
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.ids import row_seed
from rlhf_batch.store.schemas import EVAL, ROLLOUTS, with_extra

if TYPE_CHECKING:
    from rlhf_batch.envs.pool import EnvPool

SOURCE_COLUMN = "data_source"
ALL = "all"


class Eval(Stage):
    name, folder, unit = "eval", layout.EVAL, "sample"

    @classmethod
    def runs_at(cls, cfg: Config, iteration: int) -> bool:
        e = cfg.eval
        if not e.prompts or iteration > cfg.iterations:
            return False
        return iteration in (0, cfg.iterations) or (e.every > 0 and iteration % e.every == 0)

    def __init__(self, cfg: Config, iteration: int):
        super().__init__(cfg, iteration)
        e = cfg.eval
        self.sampling: GenerateConfig = dataclasses.replace(
            cfg.generate,
            prompts=e.prompts,
            num_generations=e.n,
            temperature=e.temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            max_new_tokens=e.max_new_tokens or cfg.generate.max_new_tokens,
            prompts_per_part=e.prompts_per_part,
        )
        # generate's functions read cfg.generate and cfg.seed: give them the eval sampling settings
        # and a seed stream of eval's own, so a held-out prompt that is also a training prompt
        # does not get generate's samples again (same rollout id, same per-row seed)
        self.scfg: Config = dataclasses.replace(cfg, generate=self.sampling, seed=row_seed(cfg.seed, "eval"))
        explicit = bool(e.reward_functions)
        self.reward_paths: list[str] = list(e.reward_functions if explicit else cfg.score.reward_functions)
        self.reward_weights: list[float] = list(e.reward_weights if explicit else cfg.score.reward_weights)
        self.fns: list[RewardFunction]  # prepare(): the reward functions
        self.judge: RewardFunction  # prepare(): the one that decides `correct`
        self.policy: str  # prepare(): the policy evaluated (the one the iteration starts from)
        self.tok: Any  # plan(): the policy's tokenizer
        self.prompts: Prompts  # plan(): the held-out prompts
        self.engine: Engine  # open(): what samples
        self.pool: EnvPool | None = None  # open(): the environments' workers (generate.environment)

    def identity(self) -> dict[str, Any]:
        run_level = {k: v for k, v in self.cfg.identity("generate").items() if not isinstance(v, dict)}
        return {
            **super().identity(),
            **run_level,
            "sampling": dataclasses.asdict(self.sampling),
            "reward_functions": self.reward_paths,
            "reward_weights": self.reward_weights,
        }

    def prepare(self) -> None:
        from rlhf_batch.store.modeldir import model_fingerprint

        if self.cfg.demo:  # `run` may evaluate iteration 0 before generate builds the demo assets
            from rlhf_batch.data.demo import ensure_demo_assets

            ensure_demo_assets(self.cfg)
        if not self.cfg.eval.prompts:
            raise StageError("eval.prompts: no held-out prompt file configured; set [eval] prompts")
        key = "eval.reward_functions" if self.cfg.eval.reward_functions else "score.reward_functions"
        self.fns = load_reward_functions(
            self.reward_paths, self.reward_weights, EVAL.names, reward_search_path(self.cfg), key
        )
        if not self.fns:
            raise ConfigError("eval: no reward function; set eval.reward_functions or score.reward_functions")
        self.judge = judge_of(self.fns, self.cfg.eval.correct_function)
        self.policy = start_policy(self.cfg, self.iteration)
        self.fingerprints = {
            "prompts": prompt_fingerprint(self.cfg.eval.prompts),
            "policy": model_fingerprint(self.policy, "policy"),
            "iteration": self.iteration,
        }

    def check(self) -> None:
        """The policy can be loaded (not removed by keep_policies): checked before anything is written."""
        from rlhf_batch.store.modeldir import check_model_dir

        check_model_dir(self.policy, "policy")

    def plan(self) -> int:
        from rlhf_batch.models.load import load_tokenizer

        self.tok = load_tokenizer(self.policy, self.cfg.trust_remote_code)
        self.prompts = load_prompts(self.sampling, self.tok)
        for name in self.prompts.carried.column_names:
            if name in EVAL.names or name in {rf.column for rf in self.fns}:
                raise StageError(
                    f"{self.sampling.prompts}: column '{name}' clashes with an eval column; rename it"
                )
        if not self.sampling.environment:  # else at each part: the environment's reward parts too
            check_arguments(self.fns, self.prompts.carried.column_names, describe(self.sampling.prompts))
        return math.ceil(len(self.prompts.ids) / self.sampling.prompts_per_part)

    def progress_total(self, todo: list[int]) -> int:
        per, total = self.sampling.prompts_per_part, len(self.prompts.ids)
        return sum(min(per, total - n * per) for n in todo) * self.sampling.num_generations

    def open(self, todo: list[int]) -> None:
        self.engine = make_engine(self.scfg, self.policy, self.tok, self.prompts)
        self.calls = RewardCalls.from_config(self.cfg)  # the reward cache, async calls
        g = self.sampling
        if g.environment:  # multi-turn: the turn loop of generate, with eval's sampling settings
            from rlhf_batch.stages.multiturn import open_pool

            self.pool = open_pool(self.cfg, g)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def write_parts(self, todo: list[int], out: Any, bar: Any) -> None:
        if not self.sampling.environment:
            return super().write_parts(todo, out, bar)
        from rlhf_batch.stages.multiturn import write_turn_parts

        return write_turn_parts(self, todo, out, bar)

    def on_complete(self) -> None:
        if self.sampling.environment:
            from rlhf_batch.stages.multiturn import drop_checkpoints

            drop_checkpoints(self.sdir)

    def write_part(self, n: int, bar: Any) -> Part:
        t = generate_part(
            self.engine,
            self.tok,
            self.prompts,
            n,
            self.scfg,
            self.iteration,
            self.policy,
            bar,
            pool=self.pool,
            where=self.sdir,
        )
        if self.sampling.environment:  # the environment's reward parts are known now
            carried = [c for c in t.column_names if c not in ROLLOUTS.names]
            check_arguments(self.fns, carried, describe(self.sampling.prompts))
        rid = t["rollout_id"].to_pylist()
        values, extra = reward_values(
            self.fns,
            t,
            rid,
            t["prompt_ids"].to_pylist(),
            t["response_ids"].to_pylist(),
            calls=self.calls,
        )
        reward = weighted_sum(values, {rf.column: rf.weight for rf in self.fns}, len(rid))
        threshold = self.cfg.eval.correct_threshold
        correct = [None if v is None else v >= threshold for v in values[self.judge.column]]
        for column, vals in values.items():
            t = t.append_column(pa.field(column, pa.float64()), pa.array(vals, pa.float64()))
        for column, arr in extra.items():  # verl's dict results: their other keys
            if column in t.column_names:
                raise StageError(
                    f"{self.sampling.prompts}: column '{column}' clashes with a reward function's "
                    "extra column; rename it"
                )
            t = t.append_column(pa.field(column, arr.type), arr)
        t = t.append_column(EVAL.field("reward"), pa.array(reward, pa.float64()))
        t = t.append_column(EVAL.field("correct"), pa.array(correct, pa.bool_()))
        schema = with_extra(EVAL, t.schema)
        counts = {
            "samples": t.num_rows,
            "unscored": sum(r is None for r in reward),
            **self.calls.take_counts(),
        }
        return Part(t.select(schema.names), schema, counts, list_tokens(t, "prompt_ids", "response_ids"))

    def manifest_extra(self) -> dict[str, Any]:
        return {
            "prompt_counts": self.prompts.counts,
            "policy": self.policy,
            "correct_function": self.judge.path,
            **eval_metrics(self.sdir, self.plan(), self.cfg.eval.k, self.cfg.eval.correct_threshold),
        }


def judge_of(fns: list[RewardFunction], name: str) -> RewardFunction:
    """The reward function that judges correctness: `eval.correct_function` (its name, column or
    path), by default the first."""
    if not name:
        return fns[0]
    for rf in fns:
        if name in (rf.name, rf.column, rf.path, strip_alias(rf.path)[0]):
            return rf
    raise ConfigError(
        f"eval.correct_function: {name!r} is none of the eval reward functions ({', '.join(rf.name for rf in fns)})"
    )


def eval_metrics(sdir: Any, n_parts: int, ks: list[int], threshold: float) -> dict[str, Any]:
    """Manifest entries from the parts on disk: `metrics` per data source, `overall`, and
    `prompts_unscored` (prompts left out because a sample has no reward)."""
    first: dict[int, Any] = {}
    for p in layout.list_parts(sdir):
        first.setdefault(layout.part_number(p), p)
    tables = [manifests.read_table(first[n]) for n in range(n_parts) if n in first]
    t = pa.concat_tables(tables, promote_options="permissive") if tables else EVAL.empty_table()
    pids, rewards, correct = (t[c].to_pylist() for c in ("prompt_id", "reward", "correct"))
    sources = t[SOURCE_COLUMN].to_pylist() if SOURCE_COLUMN in t.column_names else [ALL] * len(pids)
    sources = [ALL if s is None else str(s) for s in sources]
    unscored = {p for p, r in zip(pids, rewards, strict=True) if r is None}
    keep = [i for i, p in enumerate(pids) if p not in unscored]
    try:
        groups = group_samples(
            [pids[i] for i in keep],
            [sources[i] for i in keep],
            [rewards[i] for i in keep],
            correct=[bool(correct[i]) for i in keep],
        )
        return {
            "metrics": aggregate_by_source(groups, ks, threshold),
            "overall": aggregate(groups, ks, threshold),
            "prompts_unscored": len(unscored),
            "correct_threshold": threshold,
        }
    except ValueError as e:  # a prompt with two data sources
        raise StageError(f"{sdir}: {e}") from None
