"""The rows an SFT or DPO iteration learns from (train.objective; advantage's step 5b-5c).

On an iteration whose objective (Config.objective) is "sft" or "dpo", advantage writes only the
rows that objective trains on, chosen in DuckDB from the iteration's training rows (those
advantage writes for GRPO: a reward, not dropped as truncated, their group kept by the filters;
sql/advantage_candidates.sql):

* sft: the rows `advantage.select` keeps ({best = k, min_reward = x, where = "..."}, each
  optional, all must hold; sql/advantage_select.sql): rejection sampling / expert iteration.
  Equal rewards are ordered by a seeded hash of the rollout id, so the choice is fixed by the seed.
  The zero-variance filter is off on SFT iterations: a group whose rows are all right still
  shows the policy what to imitate.
* dpo: preference pairs per prompt (`advantage.pairs`, `advantage.pair_margin`;
  sql/advantage_pairs.sql), written as two rows each, the chosen then the rejected, with the
  extra columns `pair` (0, 1, ... in the order train reads them) and `chosen`; a row in several
  pairs is written once per pair. Their `ref_logprobs` are the reference log-probs score stored
  (score computes them when the schedule has a DPO iteration): train loads no reference model.

The manifest records the objective, its settings and counts: rows_out (what is written),
rows_not_selected (sft) or pairs and rows_unpaired (dpo), groups_selected / groups_paired.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.sql import sql_text

PAIRS = pa.schema([("pair", pa.int32()), ("chosen", pa.bool_())])  # dpo's extra advantages columns
KEPT = "JOIN groups AS g ON g.prompt_id = r.prompt_id AND g.dropped IS NULL"


def settings(cfg: Config, objective: str) -> dict[str, Any]:
    """What decides the rows of an `objective` iteration (advantage's identity and manifest)."""
    a = cfg.advantage
    if objective == "sft":
        return {"objective": "sft", "select": dict(a.select)}
    if objective == "dpo":
        return {"objective": "dpo", "pairs": a.pairs, "pair_margin": a.pair_margin}
    return {}


def choose(
    con: Any,
    cfg: Config,
    iteration: int,
    objective: str,
    values: dict[str, Any],
    where: str,
    kept: bool = True,
) -> None:
    """Build the temp tables `candidates` and `selected` (module docstring) from the iteration's
    parts (`values`: rollout_files, score_files); `kept`: only rows whose group the filters keep
    (the `groups` table). A `where` naming a column the rows lack is a StageError naming it."""
    a = cfg.advantage
    common = {
        "rollout_files": values["rollout_files"],
        "score_files": values["score_files"],
        "seed": cfg.seed,
        "iter": iteration,
    }
    text = sql_text("advantage_candidates").replace("/* kept */", KEPT if kept else "")
    con.execute(text, common | {"drop_truncated": a.truncated == "drop"})
    try:
        if objective == "sft":
            s = a.select
            text = sql_text("advantage_select").replace("/* where */ true", s.get("where", "true"))
            params = {"min_reward": _float(s.get("min_reward")), "best": s.get("best")}
            con.execute(text, {k: values[k] for k in ("rollout_files", "score_files")} | params)
        else:
            params = {"margin": float(a.pair_margin), "all": a.pairs == "all"}
            params |= {"bucket_tokens": a.bucket_tokens, "seed": cfg.seed, "iter": iteration}
            con.execute(sql_text("advantage_pairs"), params)
    except duckdb.Error as e:
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        what = (
            "advantage.select's where cannot run over the scored rollouts" if objective == "sft" else "pairs"
        )
        raise StageError(f"{where}: {what}: {line}") from None


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def counts(con: Any, objective: str, rows_kept: int) -> dict[str, int]:
    """The manifest's counts of the choice; `rows_kept`: the training rows before it."""
    rows, groups, pairs = con.execute(
        "SELECT count(*), count(DISTINCT c.prompt_id), count(DISTINCT s.pair) "
        "FROM selected s JOIN candidates c USING (rollout_id)"
    ).fetchall()[0]
    if objective == "sft":
        return {
            "rows_out": int(rows),
            "rows_not_selected": rows_kept - int(rows),
            "groups_selected": int(groups),
        }
    used = con.execute("SELECT count(DISTINCT rollout_id) FROM selected").fetchall()[0][0]
    return {
        "rows_out": int(rows),
        "pairs": int(pairs),
        "rows_unpaired": rows_kept - int(used),
        "groups_paired": int(groups),
    }


def why(objective: str, c: dict[str, int], cfg: Config) -> str:
    """Why an SFT or DPO iteration has no row, and the option that relaxes it ('' when it has)."""
    if objective == "sft" and c.get("rows_not_selected"):
        return f"advantage.select {cfg.advantage.select} kept none of the {c['rows_not_selected']} rows (relax it)"
    if objective == "dpo" and c.get("rows_unpaired"):
        return (
            f"no prompt has two rows whose rewards differ by more than advantage.pair_margin="
            f"{cfg.advantage.pair_margin} ({c['rows_unpaired']} rows unpaired)"
        )
    return ""


def rows_query(query: str, objective: str) -> str:
    """advantage_rows.sql for an SFT or DPO iteration: only the `selected` rows; for DPO with
    `pair` and `chosen`, in pair order, chosen first."""
    query = query.replace("/* selected */", "JOIN selected AS c ON c.rollout_id = r.rollout_id")
    if objective == "dpo":
        query = query.replace("/* c.pair */", "c.pair, c.chosen,").replace(
            "/* pair order */", "pair, chosen DESC,"
        )
    return query
