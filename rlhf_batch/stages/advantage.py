"""advantage: group advantages by prompt in DuckDB, filters, length-bucketed training parts.

Reads iter=K/rollouts and iter=K/scores (both complete) and writes iter=K/advantages: one row
per training rollout with exactly the columns of schemas.ADVANTAGES. The SQL lives in
rlhf_batch/sql/advantage_*.sql; tests/core/advantages_oracle.py is its pure-torch twin (same
semantics, tested equal). Nothing is fetched row by row into Python: DuckDB sorts and streams
Arrow batches that are cut into parts.

Semantics (config [advantage]):

* Group = rollouts with the same prompt_id. With `window` W > 1 the rollouts + scores of
  iterations K-W+1..K that are complete are pooled for the group statistics (and the batch std),
  but only iteration K's rollouts become training rows: older rollouts are off-policy, pooling
  only widens the baseline. Missing or incomplete older iterations are skipped (the manifest
  lists the iterations used in `window_iters`); iteration K itself must be complete.
* Rows whose reward is null (or NaN) are left out of every statistic and of the output
  (`unscored`). `truncated` ('length' finish_reason): 'keep'; 'drop' leaves them out like
  null rewards, before the statistics (`truncated_dropped`); 'zero' keeps them in the
  statistics and gives them advantage 0 (`truncated_zeroed`).
* Estimators: grpo (r - mean) / (std + eps) with std of the `group` (default), of the `batch`
  (every reward used, around the batch mean), or `none`; drgrpo r - mean; rloo
  n / (n - 1) * (r - mean). std uses `ddof` (default 1, sample std, like TorchRL's
  MCAdvantage); `eps` (default 1e-6) is added to the std. float64 throughout; a constant group
  (max == min, including a group of one) gets exactly 0.
* opd (on-policy distillation, needs score.teacher_model): `advantage` is grpo's, and every
  sampled response token gets teacher_logprobs - behavior_logprobs - baseline + opd_task_weight
  * advantage in the extra column `token_advantages` (`token_advantages`, after the query); on
  multi-turn rows the environment's tokens (loss_mask 0) get 0 and are left out of the baseline
  and of the manifest's `opd_reverse_kl` (`opd_mean`); the zero-variance filter is off (the
  teacher's signal does not depend on the rewards). Other estimators write
  no such column: their parts are as before.
* Group filters, in this order, each group counted once: `min_group_size` (n < min, default 2:
  `groups_dropped_small`), then `drop_zero_variance` (default on, DAPO's dynamic sampling:
  `groups_dropped_zero_variance`): the group's task scores (`score`, before any KL term) are all
  equal, or its rewards are; the KL term of a KL-shaped reward alone never keeps a group. n counts the rewards used.
* Credit per turn (advantage.turn_credit = "to_go", multi-turn rows of GRPO iterations): each
  assistant turn's advantage from its own return (sql/advantage_turns.sql), spread over its
  tokens as `token_advantages` (core/turn_credit.py); `advantage` stays the trajectory's.
* SFT and DPO iterations (train.objective; data/selection.py): only the rows the objective
  learns from are written, chosen in DuckDB after the counts: advantage.select's rows (SFT, whose
  zero-variance filter is off) or the preference pairs of advantage.pairs (DPO: two rows a pair,
  columns `pair` and `chosen`, in pair order); `rows_out` counts them.
* Output order: bucket b = len(input_ids) // bucket_tokens; buckets in a seeded shuffled order
  (md5 of '{seed}:{iter}:bucket:{b}'), rows inside a bucket in a seeded hash order (md5 of
  '{seed}:{iter}:row:{rollout_id}'). Part n (part-00000-NNNNN.parquet) holds rows
  [n * rows_per_part, (n + 1) * rows_per_part) of that order, so reading parts in order gives
  length-homogeneous runs. Part content depends only on n: a resumed run rewrites only the
  missing parts, identical to an uninterrupted run.
* Manifest `counts`: rows_in, unscored, truncated, truncated_dropped, truncated_zeroed,
  rows_dropped_small, rows_dropped_zero_variance, rows_out, pooled_rows, groups_total,
  groups_dropped_small, groups_dropped_zero_variance, groups_out (current iteration only;
  pooled_rows = older rows in the statistics); also `window_iters` and `batch_std`. Empty input
  is a StageError raised before anything is written. Every group filtered is not: the stage
  writes 0 parts and its manifest says which filters did it and how to relax each
  (`no_trainable_rows`); train then takes zero steps and carries the policy forward. Identity: config = seed + [advantage]; inputs = content hashes of
  the pooled rollouts/scores manifests (a re-scored iteration invalidates its advantages).
* Integrity (checked before anything is written): every rollout has exactly one score row with
  its prompt_id, no rollout_id repeats, no reward is +/-inf. The score stage writes its rows in
  rollouts order, so the pool is first built by position (advantage_pool.sql: one POSITIONAL
  JOIN per chunk of parts, chunks in parallel) with a per-row rollout_id/prompt_id equality
  and a duplicate check on 64-bit hashes of the ids; when any of that fails (or two hashes
  collide) it is rebuilt by a FULL JOIN on rollout_id (advantage_pool_joined.sql) and
  advantage_check.sql names the problem, or finds none (scores in another order) and the stage
  goes on with the joined pool. Both pools give the same statistics.
* md5 is used for the order, so it does not change with the DuckDB version; rows with the same
  (iter, md5, ...) cannot tie because rollout_id is the last key and is unique (checked).
* One process (rank 0) sorts and writes; other ranks under torchrun only wait.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rlhf_batch.config import Config, check_groups
from rlhf_batch.core.batching import aligned_chunks
from rlhf_batch.data import selection
from rlhf_batch.errors import SchemaError, StageError
from rlhf_batch.runtime import faults
from rlhf_batch.sql import NAN_SAFE, quote, sql_text
from rlhf_batch.stages import loss_mask, replay
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.store import fs, layout, manifests
from rlhf_batch.store.output import StageOutput
from rlhf_batch.store.schemas import (
    ADVANTAGES,
    LOSS_MASK,
    ROLLOUTS,
    SCORES,
    TEACHER,
    TOKEN_ADVANTAGES,
    validate,
    with_extra,
)

MEMORY_LIMIT = "1GB"  # DuckDB's own budget (default: 80% of RAM); the process adds Python + Arrow


class Advantage(Stage):
    """Rank 0 sorts in DuckDB and streams every part out of one query (`single_writer`)."""

    name, folder, single_writer = "advantage", layout.ADVANTAGES, True

    def __init__(self, cfg: Config, iteration: int):
        super().__init__(cfg, iteration)
        self.con: Any = None  # load(): the DuckDB connection the parts are written from
        self.window: list[int]  # prepare(): the iterations pooled for the statistics
        self.rounds: list[int]  # prepare(): the complete top-up rounds of this iteration
        self.params: dict[str, Any]  # load(): the pooled statistics' parameters
        self.counts: dict[str, int]  # load(): rows and groups in and out of the filters

    def identity(self) -> dict[str, Any]:
        ident = super().identity()
        if self.cfg.advantage.estimator != "opd":  # folders written before the keys stay complete
            ident["advantage"].pop("opd_task_weight", None)
            ident["advantage"].pop("opd_baseline", None)
        if self.cfg.advantage.reward_normalization == "sum":  # likewise
            ident["advantage"].pop("reward_normalization", None)
        if self.cfg.advantage.turn_credit != "trajectory":  # recorded when on only
            ident["advantage"]["turn_credit"] = self.cfg.advantage.turn_credit
            ident["advantage"]["turn_discount"] = self.cfg.advantage.turn_discount
        # an SFT or DPO iteration (train.objective): its objective and what chooses its rows
        ident["advantage"] |= selection.settings(self.cfg, self.cfg.objective(self.iteration))
        return ident

    def prepare(self) -> None:
        if self.iteration < 0:
            raise StageError(f"--iter must be >= 0, got {self.iteration}")
        check_groups(self.cfg)
        self.window = _window(self.cfg, self.iteration)
        self.rounds = topup_rounds(self.cfg, self.iteration)
        inputs: dict[str, Any] = {
            f"{layout.iter_name(it)}/{folder}": manifests.file_fingerprint(
                layout.folder(self.cfg.run_dir, it, folder) / layout.MANIFEST
            )
            for it in self.window
            for folder in (layout.ROLLOUTS, layout.SCORES)
        }
        for r in self.rounds:  # top-up rounds of this iteration, one table with round 0
            for folder in (layout.ROLLOUTS, layout.SCORES):
                path = layout.folder(self.cfg.run_dir, self.iteration, folder, r) / layout.MANIFEST
                name = f"{layout.iter_name(self.iteration)}/{layout.topup_name(r)}/{folder}"
                inputs[name] = manifests.file_fingerprint(path)
        if replay.enabled(self.cfg):  # the replayed iterations' advantages (replay.py); off: left out
            inputs["replay"] = replay.inputs(self.cfg, self.iteration)
        self.fingerprints = inputs

    def load(self) -> None:
        """Pool, check and count in DuckDB: bad or empty input fails before the folder is started."""
        self.work_begins()  # no model to load: pooling is work
        self.con = _connect(
            fs.local_side(self.cfg.run_dir, layout.DUCKDB_SPILL)
        )  # DuckDB spills to local files
        # the inputs are committed and nothing else writes the run (its lock): one listing of it
        # answers every look at them (on a store each footer read and each DuckDB open of a part,
        # once per statement, was a HEAD of its own)
        inputs = fs.snapshot(fs.run_path(self.cfg.run_dir))
        fs.register(self.con, inputs, replace=True)
        self.params = _prepare(self.con, self.cfg, self.iteration, self.window, self.rounds, inputs)
        faults.fault_point("advantages:pool")
        self.counts = _counts(self.con, self.cfg, self.iteration)
        self.objective = self.cfg.objective(self.iteration)
        if self.objective != "grpo":  # SFT or DPO: only the rows it learns from (selection.py)
            selection.choose(
                self.con,
                self.cfg,
                self.iteration,
                self.objective,
                self.params,
                _where(self.cfg, self.iteration),
            )
            self.counts |= selection.counts(self.con, self.objective, self.counts["rows_out"])
        self.replayed = None
        if replay.enabled(self.cfg):  # stored rows of earlier iterations, after the own ones
            self.replayed = replay.choose(self.con, self.cfg, self.iteration, self.counts["rows_out"])
            self.counts["rows_replayed"] = self.replayed.rows

    def plan(self) -> int:
        self.own_parts = math.ceil(self.counts["rows_out"] / self.cfg.advantage.rows_per_part)
        return self.own_parts + replay.parts(self.replayed, self.cfg.advantage.rows_per_part)

    def write_parts(self, todo: list[int], out: StageOutput, bar: Any) -> None:
        own = [n for n in todo if n < self.own_parts]
        _write_parts(self.con, out, self.cfg, self.iteration, self.params, own, bar, self.objective)
        if self.replayed is not None:
            replay.write_parts(
                self.con, self.cfg, self.iteration, self.replayed, self.own_parts, todo, out, bar
            )

    def manifest_extra(self) -> dict[str, Any]:
        extra = {"counts": self.counts, "window_iters": self.window, "batch_std": self.params["batch_std"]}
        extra |= self.params.get("opd", {})  # opd: its baseline and reverse KL to the teacher
        extra |= selection.settings(self.cfg, self.objective)  # sft, dpo: the objective and its rows
        if self.params["reward_parts"]:
            extra["reward_parts"] = self.params["reward_parts"]
        if self.cfg.advantage.min_groups:
            extra["topup_rounds"] = self.rounds
        if self.replayed is not None:
            extra["replay"] = replay.record(self.cfg, self.iteration, self.replayed)
        if self.counts["rows_out"] == 0:  # train takes zero steps and says why
            why = selection.why(self.objective, self.counts, self.cfg) or _why(self.counts, self.cfg)
            extra["no_trainable_rows"] = f"every training row was filtered out: {why}"
        return extra

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            _release()


def topup_rounds(cfg: Config, iteration: int) -> list[int]:
    """The complete top-up rounds 1, 2, ... of iteration `iteration` (up to the first missing)."""
    out: list[int] = []
    for r in range(1, cfg.advantage.max_topup_rounds + 1):
        folders = (layout.folder(cfg.run_dir, iteration, f, r) for f in (layout.ROLLOUTS, layout.SCORES))
        if not all(manifests.manifest(d) is not None for d in folders):
            break
        out.append(r)
    return out


def informative_groups(cfg: Config, iteration: int) -> int:
    """Groups of iteration `iteration` (round 0 and its complete top-up rounds) that the filters
    leave: what `advantage.min_groups` is compared with."""
    stage = Advantage(cfg, iteration)
    try:
        stage.prepare()
        stage.load()
        return stage.counts["groups_out"]
    finally:
        stage.close()


def _window(cfg: Config, iteration: int) -> list[int]:
    """The iterations pooled for the statistics: iteration K (required) and the complete ones
    among the W - 1 before it."""
    for stage, command in (("rollouts", "generate"), ("scores", "score")):
        sdir = layout.folder(cfg.run_dir, iteration, stage)
        if manifests.manifest(sdir) is None:
            raise StageError(
                f"{sdir}: {stage} of iteration {iteration} is not complete (no {layout.MANIFEST}); "
                f"run `rlhf-batch {command} --iter {iteration}` first"
            )
    older = range(max(0, iteration - cfg.advantage.window + 1), iteration)
    complete = [
        it
        for it in older
        if all(
            manifests.manifest(layout.folder(cfg.run_dir, it, s)) is not None for s in ("rollouts", "scores")
        )
    ]
    return [*complete, iteration]


def _where(cfg: Config, iteration: int) -> str:
    return f"iteration {iteration} ({layout.iter_dir(cfg.run_dir, iteration)})"


def _parts(
    run_dir: str | Path, it: int, stage: str, schema: pa.Schema, topup: int = 0
) -> list[tuple[str, int]]:
    """(path, rows) of the parts a complete stage's manifest lists, schema-checked (errors name
    file and column); rows from the file's footer."""
    sdir = layout.folder(run_dir, it, stage, topup)
    out = []
    for p in (manifests.manifest(sdir) or {}).get("parts", []):
        path = sdir / p["file"]
        try:
            meta = manifests.parquet_file(path).metadata
        except (OSError, pa.ArrowInvalid) as e:
            raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
        validate(meta.schema.to_arrow_schema(), schema, str(path))
        out.append((str(path.resolve()), meta.num_rows))
    return out


_DB: dict[str, Any] = {}  # this process's database: pid, tmp (its spill directory), db


def _connect(tmp: Path) -> Any:
    """A connection of its own (its temp tables and macros go with it) to this process's
    in-memory DuckDB database spilling to `tmp`: opening a database costs ~10 ms, a connection
    ~0.5 ms, and `run` pools every iteration. DuckDB cannot move a database's spill directory
    once used, so another `tmp` (another run) closes the database first; a forked child opens
    its own."""
    import duckdb

    if _DB.get("pid") != os.getpid() or _DB.get("tmp") != tmp:
        _close_db()
        _DB.update(pid=os.getpid(), tmp=tmp, db=duckdb.connect(":memory:"))
        _DB["db"].execute(f"SET temp_directory = {quote(str(tmp))}")  # spills of a 10M-row sort go here
    con = _DB["db"].cursor()
    con.execute("SET enable_progress_bar = false")
    con.execute(NAN_SAFE)  # NaN rewards must count as null
    con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")  # beyond it DuckDB spills: 10M rows stay < 2 GB RSS
    con.execute("SET preserve_insertion_order = false")  # temp tables in any order: parallel writes
    return con


def _release() -> None:
    """Give the memory of the closed connections back: DuckDB keeps a finished query's memory
    (600 MB after sorting 5M rows) until its limit shrinks, and train runs next in this process.
    Lowering the limit empties its buffers (back to ~75 MB); the next connection sets it again."""
    import duckdb

    try:
        _DB["db"].execute("SET memory_limit = '16MB'")
        _DB["db"].execute("SELECT 1").fetchall()
    except duckdb.Error:  # could not shrink: close the database instead
        _close_db()


def _close_db() -> None:
    """Close this process's database and remove its spill directory (at exit, or for another);
    a forked child's copy of its parent's is only forgotten."""
    if _DB.get("pid") == os.getpid():
        _DB["db"].close()
        shutil.rmtree(_DB["tmp"], ignore_errors=True)
    _DB.clear()


atexit.register(_close_db)


def _prepare(
    con: Any,
    cfg: Config,
    iteration: int,
    window: list[int],
    rounds: tuple[int, ...] | list[int] = (),
    inputs: str | Path | None = None,
) -> dict[str, Any]:
    """Build the `pool` and `groups` temp tables; check integrity; return the query parameters.
    The top-up `rounds` of `iteration` are read after its round 0, as one table. `inputs`: the
    run directory to read them through (`fs.snapshot`), by default `cfg.run_dir`."""
    a = cfg.advantage
    src = cfg.run_dir if inputs is None else inputs
    score_schema = with_extra(SCORES, TEACHER) if a.estimator == "opd" else SCORES  # opd: teacher log-probs
    rollouts = {it: _parts(src, it, "rollouts", ROLLOUTS) for it in window}
    scores = {it: _parts(src, it, "scores", score_schema) for it in window}
    for r in rounds:
        rollouts[iteration] += _parts(src, iteration, "rollouts", ROLLOUTS, r)
        scores[iteration] += _parts(src, iteration, "scores", score_schema, r)
    for stage in ("rollouts", "scores"):
        if not (manifests.manifest(layout.folder(src, iteration, stage)) or {}).get("rows"):
            raise StageError(
                f"{_where(cfg, iteration)}: {stage} are empty (0 rows); nothing to compute advantages from"
            )
    if not _aligned_pool(con, rollouts, scores, a.truncated == "drop"):
        con.execute(
            sql_text("advantage_pool_joined"),
            {
                "rollout_files": [f for it in window for f, _ in rollouts[it]],
                "score_files": [f for it in window for f, _ in scores[it]],
                "drop_truncated": a.truncated == "drop",
            },
        )
        _check(con, cfg.run_dir)
    parts = None
    if a.reward_normalization == "per_part":  # GDPO: the pool's rewards become normalised sums
        files = [f for it in window for f, _ in rollouts[it]], [f for it in window for f, _ in scores[it]]
        parts = _per_part(con, cfg, iteration, window, src, *files)
    con.execute(
        sql_text("advantage_groups"),
        {
            "iter": iteration,
            "ddof": a.ddof,
            "min_group_size": a.min_group_size,
            # opd: every rollout carries the teacher's signal, equal rewards or not; sft: a group
            # whose rows are all right still shows what to imitate (selection.py)
            "drop_zero_variance": a.drop_zero_variance
            and a.estimator != "opd"
            and cfg.objective(iteration) != "sft",
        },
    )
    batch_std = None
    if a.estimator in ("grpo", "opd") and a.scale == "batch":  # opd: its grpo part
        batch_std = float(
            con.execute(sql_text("advantage_batch_std"), {"ddof": a.ddof}).fetchall()[0][0] or 0.0
        )
    folders = [layout.folder(src, iteration, "rollouts", r) for r in (0, *rounds)]
    params: dict[str, Any] = {
        "rollout_files": [f for f, _ in rollouts[iteration]],
        "score_files": [f for f, _ in scores[iteration]],
        "batch_std": batch_std,
        "loss_mask": loss_mask.has_mask(folders),  # multi-turn rollouts: carried to train
        "reward_parts": parts,
    }
    if a.estimator == "opd":  # over the sampled tokens of the scored rollouts (the manifest's)
        mean, tokens = opd_mean(con, params, params["loss_mask"])
        params["opd"] = {
            "opd_baseline": mean if a.opd_baseline == "mean" else 0.0,
            "opd_reverse_kl": -mean,
            "opd_sampled_tokens": tokens,
        }
    return params


def _per_part(
    con: Any,
    cfg: Config,
    iteration: int,
    window: list[int],
    src: str | Path,
    rollout_files: list[str],
    score_files: list[str],
) -> dict[str, float]:
    """advantage.reward_normalization = "per_part" (GDPO): the temp table `gdpo` (iter,
    rollout_id, signal) and the pool's reward and score replaced by each used row's
    sum over reward_raw's parts of weight x (part - group mean) / (group std + eps) (a part
    constant in the group: 0), every statistic over the group's used rows (advantage_parts.sql);
    returns the parts and weights, which every pooled iteration's scores manifest must record
    alike."""
    from rlhf_batch.sql import quote_ident

    a = cfg.advantage
    found = {
        it: (manifests.manifest(layout.folder(src, it, layout.SCORES)) or {}).get("reward_parts")
        for it in window
    }
    parts = found[iteration]
    if not parts:
        raise StageError(
            f"{_where(cfg, iteration)}: its scores manifest records no reward_parts (scored by an older "
            "version); run score again (--force) for advantage.reward_normalization = 'per_part'"
        )
    if other := [it for it in window if found[it] != parts]:
        raise StageError(
            f"{_where(cfg, iteration)}: iteration {other[0]} was scored with other reward parts "
            f"({found[other[0]]} vs {parts}); advantage.reward_normalization = 'per_part' pools only "
            "iterations scored alike (advantage.window)"
        )
    cols = [quote_ident(c) for c in parts]
    std = "list_stddev_samp" if a.ddof == 1 else "list_stddev_pop"
    text = sql_text("advantage_parts")
    text = text.replace("/* parts */", "".join(f"{c}, " for c in cols))
    text = text.replace("/* lists */", "".join(f"list_sort(list({c})) AS l{i}, " for i, c in enumerate(cols)))
    terms = [
        f"{float(w)!r} * CASE WHEN list_min(t.l{i}) = list_max(t.l{i}) THEN 0.0 "
        f"ELSE (u.{c} - list_avg(t.l{i})) / ({std}(t.l{i}) + $eps) END"
        for i, (c, w) in enumerate(zip(cols, parts.values(), strict=True))
    ]
    text = text.replace("/* signal */", " + ".join(terms))
    values = {"rollout_files": rollout_files, "score_files": score_files, "eps": a.eps}
    con.execute(text, values | {"drop_truncated": a.truncated == "drop"})
    key = "h" if "h" in {r[0] for r in con.execute("DESCRIBE pool").fetchall()} else "rollout_id"
    con.execute(
        f"UPDATE pool SET reward = g.signal, score = g.signal FROM gdpo g "
        f"WHERE pool.iter = g.iter AND pool.{key} = g.{key}"
    )
    return dict(parts)


def _aligned_pool(
    con: Any, rollouts: dict[int, list[tuple[str, int]]], scores: dict[int, list[tuple[str, int]]], drop: bool
) -> bool:
    """The pool of advantage_pool.sql: rollouts and scores lined up by position, in chunks cut
    where both have a part boundary (one positional join per chunk, chunks in parallel). True
    when it is good (every row aligned, no +/-inf reward, no duplicate id); False: the caller
    rebuilds it by rollout_id, which names the problem."""
    con.execute(sql_text("advantage_pool"))
    threads = int(con.execute("SELECT current_setting('threads')").fetchall()[0][0])
    calls: list[str] = []
    params: dict[str, Any] = {"drop": drop}
    for it in rollouts:
        r, s = rollouts[it], scores[it]
        for ri, si in aligned_chunks([n for _, n in r], [n for _, n in s], 2 * threads):
            if not ri or not si:  # rows on one side only: not aligned
                return False
            k = len(calls)
            calls.append(f"FROM aligned_pool($r{k}, $s{k}, {it:d}, $drop)")
            params |= {f"r{k}": [r[i][0] for i in ri], f"s{k}": [s[j][0] for j in si]}
    con.execute("CREATE OR REPLACE TEMP TABLE pool AS " + " UNION ALL ".join(calls), params)
    if con.execute(sql_text("advantage_aligned")).fetchall()[0][0]:
        return False
    ids = np.sort(con.sql("SELECT h FROM pool").fetchnumpy()["h"])  # [rows] uint64
    return not bool((ids[1:] == ids[:-1]).any())  # equal hashes: a duplicate (or a collision)


_PROBLEMS = {  # advantage_check.sql column -> what is wrong, the folders to redo
    "duplicate": ("rows share their rollout_id in rollouts or scores", "rollouts scores"),
    "unmatched_rollout": ("rollouts have no score row", "score"),
    "unmatched_score": ("score rows match no rollout", "score"),
    "prompt_mismatch": ("score rows have another prompt_id than their rollout", "scores"),
    "infinite": ("rewards are +/-inf", "scores"),
}


def _check(con: Any, run_dir: str) -> None:
    cur = con.execute(sql_text("advantage_check"))
    row = dict(zip([d[0] for d in cur.description], cur.fetchall()[0], strict=True))
    for key, (what, fix) in _PROBLEMS.items():
        if row[key]:
            it = row[f"{key}_iter"]
            raise StageError(
                f"{layout.iter_dir(run_dir, it)}: {row[key]} {what} (e.g. rollout_id {row[f'{key}_id']!r}); "
                "redo it with "
                + " then ".join(layout.redo_command(layout.folder(run_dir, it, f)) for f in fix.split())
            )


def _counts(con: Any, cfg: Config, iteration: int) -> dict[str, int]:
    """What the filters did (the manifest's counts). Nothing left to train on is not an error:
    the stage writes 0 parts and says why in the manifest (`no_trainable_rows`)."""
    values = {"iter": iteration, "zero_truncated": cfg.advantage.truncated == "zero"}
    cur = con.execute(sql_text("advantage_counts"), values)
    return {d[0]: int(v) for d, v in zip(cur.description, cur.fetchall()[0], strict=True)}


def _why(c: dict[str, int], cfg: Config) -> str:
    """Which filters removed the rows, and the option that relaxes each."""
    a, why = cfg.advantage, []
    if c["unscored"]:
        why.append(f"{c['unscored']} of {c['rows_in']} rows have a null reward (see score)")
    if c["truncated_dropped"]:
        why.append(
            f"{c['truncated_dropped']} truncated rows dropped (set advantage.truncated='zero' or 'keep')"
        )
    if c["groups_dropped_small"]:
        why.append(
            f"{c['groups_dropped_small']} of {c['groups_total']} groups smaller than "
            f"advantage.min_group_size={a.min_group_size} (lower it)"
        )
    if c["groups_dropped_zero_variance"]:
        why.append(
            f"{c['groups_dropped_zero_variance']} of {c['groups_total']} groups whose task scores (or rewards) are all equal "
            "(set advantage.drop_zero_variance=false to keep them with advantage 0)"
        )
    return "; ".join(why) or "no group has a scored rollout"


def _write_parts(
    con: Any,
    out: StageOutput,
    cfg: Config,
    iteration: int,
    params: dict[str, Any],
    todo: list[int],
    bar: Any,
    objective: str = "grpo",
) -> None:
    """Stream the ordered rows out of DuckDB and write the parts `todo` (those not on disk yet)."""
    a = cfg.advantage
    if not todo:
        return
    values = {
        "rollout_files": params["rollout_files"],
        "score_files": params["score_files"],
        "iter": iteration,
        "estimator": a.estimator,
        "scale": a.scale,
        "eps": a.eps,
        "batch_std": params["batch_std"] or 0.0,
        "zero_truncated": a.truncated == "zero",
        "drop_truncated": a.truncated == "drop",
        "bucket_tokens": a.bucket_tokens,
        "seed": cfg.seed,
    }
    query, schema = sql_text("advantage_rows"), ADVANTAGES
    if params["reward_parts"]:  # GDPO: the advantage of the normalised sum of the parts
        query = query.replace(
            "reward, reward AS signal\n    FROM read_parquet($score_files, union_by_name = true)",
            "reward, p.signal\n    FROM read_parquet($score_files, union_by_name = true)"
            " JOIN (SELECT rollout_id, signal FROM gdpo WHERE iter = $iter) p USING (rollout_id)",
        )
    if a.estimator == "opd":
        query = query.replace("/* teacher_logprobs */", "teacher_logprobs,")
        schema = with_extra(ADVANTAGES, TOKEN_ADVANTAGES)
    if params["loss_mask"]:
        query = query.replace("/* loss_mask */", "loss_mask,").replace("/* r.loss_mask */", "r.loss_mask,")
        schema = with_extra(schema, LOSS_MASK)
    if objective != "grpo":  # SFT or DPO: the chosen rows (selection.py)
        query = selection.rows_query(query, objective)
        schema = with_extra(schema, selection.PAIRS) if objective == "dpo" else schema
    baseline = params["opd"]["opd_baseline"] if a.estimator == "opd" else 0.0
    turns = None
    if a.turn_credit == "to_go" and objective == "grpo" and params["loss_mask"]:
        given = {k: values[k] for k in TURN_PARAMS} | {"ddof": a.ddof, "discount": a.turn_discount}
        turns = _turn_advantages(con, given)
        schema = with_extra(schema, TOKEN_ADVANTAGES)
    reader = con.sql(query, params=values).to_arrow_reader(min(a.rows_per_part, 65536))
    wanted = set(todo)
    for n, table in enumerate(_chunks(reader, a.rows_per_part)):
        if n in wanted:
            if a.estimator == "opd":
                table = table.append_column(
                    "token_advantages",
                    token_advantages(table, a.opd_task_weight, _where(cfg, iteration), baseline),
                )
            if turns is not None:
                table = table.append_column("token_advantages", _per_turn(table, turns))
            out.write(n, Part(table, schema, tokens=list_tokens(table, "input_ids")))
            bar.update(1)
        if n >= max(todo):
            break
    reader.close()


# advantage_rows.sql's parameters that advantage_turns.sql reads too
TURN_PARAMS = (
    "rollout_files",
    "score_files",
    "estimator",
    "scale",
    "eps",
    "batch_std",
    "zero_truncated",
    "drop_truncated",
)


def _turn_advantages(con: Any, values: dict[str, Any]) -> dict[str, tuple[list, list, list]]:
    """advantage.turn_credit = "to_go": rollout_id -> (turn_starts, turn_roles, the advantage of
    each turn) of the iteration's multi-turn training rows (sql/advantage_turns.sql)."""
    query = sql_text("advantage_turns")
    have = con.execute(
        "DESCRIBE SELECT * FROM read_parquet($f, union_by_name = true)", {"f": values["rollout_files"]}
    ).fetchall()
    if "turn_rewards" not in {c[0] for c in have}:  # imported trajectories: nothing earned per turn
        query = query.replace("turn_roles, turn_rewards,", "turn_roles, NULL::DOUBLE[] AS turn_rewards,")
    con.execute(query, values)
    rows = con.execute("SELECT rollout_id, turn_starts, turn_roles, per_turn FROM turn_advantages").fetchall()
    return {rid: (starts, roles, per_turn) for rid, starts, roles, per_turn in rows}


def _per_turn(table: pa.Table, turns: dict[str, tuple[list, list, list]]) -> pa.ListArray:
    """The per-token advantages of a part's rows under advantage.turn_credit = "to_go"
    (core/turn_credit.py); a row without turns (single-turn, or not in `turns`) has its
    advantage on every token."""
    from rlhf_batch.core.turn_credit import turn_token_advantages

    lens = [len(b) for b in table.column("behavior_logprobs").to_pylist()]
    adv = table.column("advantage").to_pylist()
    out = []
    for rid, n, a in zip(table.column("rollout_id").to_pylist(), lens, adv, strict=True):
        starts, roles, per_turn = turns.get(rid, ([0], ["assistant"], []))
        out.append(turn_token_advantages(n, starts or [0], roles or ["assistant"], a, per_turn))
    flat = np.concatenate(out) if out else np.zeros(0, np.float32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.float32()))


_OPD_FROM = (
    "FROM read_parquet($rollout_files, union_by_name = true) r "
    "JOIN read_parquet($score_files, union_by_name = true) s USING (rollout_id) "
    "WHERE s.reward IS NOT NULL AND NOT isnan(s.reward) AND len(s.teacher_logprobs) = len(r.behavior_logprobs)"
)
# multi-turn rollouts: the sampled tokens only (loss_mask 1; a null mask is all ones), not the
# environment's, whose behaviour log-prob is 0.0 by convention
_OPD_MASKED = (
    "SELECT sum(t::DOUBLE - b::DOUBLE) FILTER (WHERE m = 1), count(*) FILTER (WHERE m = 1) FROM ("
    "SELECT unnest(s.teacher_logprobs) AS t, unnest(r.behavior_logprobs) AS b, "
    "unnest(coalesce(r.loss_mask, list_transform(r.behavior_logprobs, lambda x: 1::TINYINT))) AS m "
    f"{_OPD_FROM})"
)


def opd_mean(con: Any, values: dict[str, Any], masked: bool = False) -> tuple[float, int]:
    """(mean, tokens): the mean of teacher_logprobs - behavior_logprobs over every sampled token of
    the iteration's scored rollouts (float64; 0 when there is none), and how many tokens that is.
    `masked`: the rollouts have `loss_mask` (multi-turn), and only its tokens of 1 count. The
    baseline of advantage.opd_baseline = "mean", and minus the sampled-token estimate of the
    reverse KL to the teacher: one number per iteration, whatever the parts, so each part's
    advantages are known alone."""
    query = (
        _OPD_MASKED
        if masked
        else "SELECT sum(list_sum(s.teacher_logprobs)::DOUBLE) - sum(list_sum(r.behavior_logprobs)::DOUBLE), "
        f"sum(len(r.behavior_logprobs)) {_OPD_FROM}"
    )
    row = con.execute(
        query, {"rollout_files": values["rollout_files"], "score_files": values["score_files"]}
    ).fetchall()
    diff, tokens = row[0] if row else (None, None)
    return (float(diff) / float(tokens) if diff is not None and tokens else 0.0), int(tokens or 0)


def token_advantages(table: pa.Table, weight: float, where: str, baseline: float = 0.0) -> pa.ListArray:
    """opd's advantage of every response token: teacher_logprobs - behavior_logprobs (the per-token
    reverse KL's negative, no discount) - `baseline` (opd_baseline) + weight x the row's group
    advantage, in float64, stored as float32. A row whose teacher log-probs are null, of another length or not finite is a
    StageError naming it."""
    import pyarrow.compute as pc

    rids = table.column("rollout_id")
    teacher = table.column("teacher_logprobs").combine_chunks()  # list<float32> [N]
    behavior = table.column("behavior_logprobs").combine_chunks()  # list<float32> [N]
    lens = pc.list_value_length(behavior).to_numpy(zero_copy_only=False)  # [N]
    bad = pc.fill_null(pc.not_equal(pc.list_value_length(teacher), pc.list_value_length(behavior)), True)
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise StageError(
            f"{where}: rollout {rids[row]}: column 'teacher_logprobs' is null or not one value per "
            "response token; score the iteration again with score.teacher_model set"
        )
    t = pc.list_flatten(teacher).to_numpy(zero_copy_only=False).astype(np.float64)  # [sum T]
    b = pc.list_flatten(behavior).to_numpy(zero_copy_only=False).astype(np.float64)  # [sum T]
    adv = table.column("advantage").to_numpy().astype(np.float64)  # [N]
    tok = (t - b - baseline + weight * np.repeat(adv, lens)).astype(np.float32)  # [sum T]
    sampled = loss_mask.flat_mask(table, lens)  # [sum T] bool, None: every token sampled
    if sampled is not None:  # the environment's tokens (multi-turn) are not the policy's: 0
        tok = np.where(sampled, tok, np.float32(0.0))
    if not np.isfinite(tok).all():
        row = int(np.searchsorted(np.cumsum(lens), np.flatnonzero(~np.isfinite(tok))[0], side="right"))
        raise StageError(f"{where}: rollout {rids[row]}: column 'teacher_logprobs' has a NaN or inf log-prob")
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # [N + 1]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(tok, pa.float32()))


def _chunks(reader: pa.RecordBatchReader, size: int) -> Any:
    """Tables of exactly `size` rows (the last one shorter) from a stream of record batches."""
    buf: list[pa.RecordBatch] = []
    held = 0
    for batch in reader:
        buf.append(batch)
        held += batch.num_rows
        while held >= size:
            table = pa.Table.from_batches(buf)
            yield table.slice(0, size)
            rest = table.slice(size)
            buf, held = rest.to_batches(), rest.num_rows
    if held:
        yield pa.Table.from_batches(buf, schema=reader.schema)
