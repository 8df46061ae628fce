-- advantage, step 1, exact path: the pool of advantage_pool.sql built by joining on rollout_id,
-- when the rows of rollouts and scores do not line up by position (scores written in another
-- order, missing, extra or duplicate rows, other prompt_ids, +/-inf rewards).
--   $rollout_files, $score_files: the parts listed in the window's manifests (hive paths, iter=K)
--   $drop_truncated: advantage.truncated = 'drop'
-- A FULL JOIN keeps rollouts without a score and scores without a rollout, so the integrity
-- check (advantage_check.sql) can name them. NaN rewards count as null (no reward).
CREATE OR REPLACE TEMP TABLE pool AS
WITH r AS (
    SELECT iter, rollout_id, prompt_id, coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, hive_partitioning = true, hive_types = {'iter': INTEGER},
                      union_by_name = true)
), s AS (
    SELECT iter, rollout_id, prompt_id, CASE WHEN isnan(reward) THEN NULL ELSE reward END AS reward,
           CASE WHEN isnan(score) THEN NULL ELSE score END AS score
    FROM read_parquet($score_files, hive_partitioning = true, hive_types = {'iter': INTEGER},
                      union_by_name = true)
)
SELECT
    coalesce(r.iter, s.iter) AS iter,
    coalesce(r.rollout_id, s.rollout_id) AS rollout_id,
    r.prompt_id,
    r.rollout_id IS NOT NULL AS in_rollouts,
    s.rollout_id IS NOT NULL AS in_scores,
    s.prompt_id IS DISTINCT FROM r.prompt_id AS prompt_mismatch,
    s.reward,
    s.score,
    coalesce(r.truncated, false) AS truncated,
    -- rows that enter the group statistics
    s.reward IS NOT NULL AND NOT (coalesce(r.truncated, false) AND $drop_truncated) AS used
FROM r FULL JOIN s ON r.iter = s.iter AND r.rollout_id = s.rollout_id;
