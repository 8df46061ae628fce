-- advantage, step 1: one row per pooled rollout, scalar columns only, so 10M rollouts cost a few
-- hundred MB here and never touch Python. The score stage writes one row per rollout in rollouts
-- order, so a chunk of rollouts parts and the scores parts that hold the same rows line up by
-- position: a POSITIONAL JOIN (no hash join on the string rollout_id); the stage runs one such
-- chunk per thread (UNION ALL of aligned_pool(...) calls, chunks cut by core.batching.aligned_chunks).
--   rollout_files, score_files: the parts of one chunk of iteration `it`
--   drop_truncated: advantage.truncated = 'drop'
-- `aligned`: the row's rollout_id and prompt_id are the same on both sides (false where one side
-- is shorter, POSITIONAL JOIN pads it with nulls); `h`: a hash of (iter, rollout_id) for the
-- duplicate check. Only when every row is aligned, no reward is +/-inf and no two h are equal
-- is this pool used; otherwise advantage_pool_joined.sql rebuilds it by rollout_id and
-- advantage_check.sql names the problem. NaN rewards count as null (no reward). `score` (the
-- task score, before the KL term) is what the zero-variance filter judges (advantage_groups.sql).
CREATE OR REPLACE TEMP MACRO aligned_pool(rollout_files, score_files, it, drop_truncated) AS TABLE
SELECT
    it AS iter,
    r.prompt_id,
    s.reward,
    s.score,
    coalesce(r.truncated, false) AS truncated,
    -- rows that enter the group statistics
    s.reward IS NOT NULL AND NOT (coalesce(r.truncated, false) AND drop_truncated) AS used,
    coalesce(r.rollout_id = s.rollout_id AND r.prompt_id = s.prompt_id, false) AS aligned,
    hash(it, r.rollout_id) AS h
FROM (
    SELECT rollout_id, prompt_id, finish_reason = 'length' AS truncated
    FROM read_parquet(rollout_files, union_by_name = true)
) AS r
POSITIONAL JOIN (
    SELECT rollout_id, prompt_id, CASE WHEN isnan(reward) THEN NULL ELSE reward END AS reward,
           CASE WHEN isnan(score) THEN NULL ELSE score END AS score
    FROM read_parquet(score_files, union_by_name = true)
) AS s;
