-- advantage, step 6b (advantage.turn_credit = 'to_go'; core/turn_credit.py): the advantage of
-- each assistant turn k >= 2 of the current iteration's training rows, as the temp table
-- `turn_advantages` (rollout_id, later: one value per turn 2, 3, ..., null where the turn has no
-- baseline of its own). Parameters as advantage_rows.sql, and $ddof.
-- The return of turn k is what the trajectory earned from turn k on: its reward minus the
-- `turn_rewards` of turns 1..k-1 (the environment's Step.reward; null: none earned). Each turn k
-- is normalised among the rows of its group that reached turn k, with the estimator and scale
-- of the trajectory's advantage (advantage_rows.sql): constant returns -> 0; a truncated row
-- with truncated = 'zero' -> 0; fewer than 2 rows reaching turn k -> null (the row keeps its
-- trajectory's advantage there). float64.
CREATE OR REPLACE TEMP TABLE turn_advantages AS
WITH r AS (
    SELECT rollout_id, prompt_id, turns, turn_rewards,
           coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, union_by_name = true)
), s AS (
    SELECT rollout_id, reward
    FROM read_parquet($score_files, union_by_name = true)
    WHERE reward IS NOT NULL AND NOT isnan(reward)
), turned AS (
    SELECT r.rollout_id, r.prompt_id, r.truncated, s.reward, r.turn_rewards,
           unnest(range(2, coalesce(r.turns, 1) + 1)) AS k
    FROM r
    JOIN s USING (rollout_id)
    JOIN groups AS g ON g.prompt_id = r.prompt_id
    WHERE NOT (r.truncated AND $drop_truncated) AND g.dropped IS NULL
), returns AS (
    SELECT rollout_id, prompt_id, truncated, k,
           reward - coalesce(list_sum(list_slice(turn_rewards, 1, k - 1)), 0.0) AS ret
    FROM turned
), stats AS (
    SELECT prompt_id, k, count(*) AS n, min(ret) = max(ret) AS constant,
           list_sort(list(ret)) AS sorted
    FROM returns
    GROUP BY prompt_id, k
), adv AS (
    SELECT x.rollout_id, x.k,
        CASE
            WHEN st.n < 2 THEN NULL
            WHEN st.constant OR (x.truncated AND $zero_truncated) THEN 0.0
            WHEN $estimator = 'rloo' THEN (x.ret - list_avg(st.sorted)) * st.n / (st.n - 1)
            WHEN $estimator = 'drgrpo' OR $scale = 'none' THEN x.ret - list_avg(st.sorted)
            WHEN $scale = 'batch' THEN (x.ret - list_avg(st.sorted)) / ($batch_std + $eps)
            WHEN $ddof = 1 THEN (x.ret - list_avg(st.sorted)) / (list_stddev_samp(st.sorted) + $eps)
            ELSE (x.ret - list_avg(st.sorted)) / (list_stddev_pop(st.sorted) + $eps)
        END AS a
    FROM returns AS x
    JOIN stats AS st USING (prompt_id, k)
)
SELECT rollout_id, list(a ORDER BY k) AS later
FROM adv
GROUP BY rollout_id;
