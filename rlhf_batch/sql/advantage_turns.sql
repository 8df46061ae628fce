-- advantage, step 6b (advantage.turn_credit = 'to_go'; core/turn_credit.py): the advantage of
-- each assistant turn of the current iteration's training rows, as the temp table
-- `turn_advantages` (rollout_id, turn_starts, turn_roles, per_turn: one value per turn 1, 2, ...,
-- null where the row keeps its trajectory's advantage). Parameters as advantage_rows.sql, and $ddof, $discount.
-- What turn j earned, r_j: the environment's `turn_rewards[j]` (Step.reward; null: 0.0) for every
-- turn but the last, whose r_j is the rest of the reward (reward minus the others), so the r_j
-- sum to the reward. The return of turn k: sum over j >= k of $discount^(j - k) r_j
-- (advantage.turn_discount; with 1, the reward minus what turns 1..k-1 earned). Each turn k is
-- normalised among the rows of its group that reached turn k, with the estimator and scale of
-- the trajectory's advantage (advantage_rows.sql): constant returns -> 0; a truncated row with
-- truncated = 'zero' -> 0; fewer than 2 rows reaching turn k -> null. Turn 1 with $discount = 1
-- returns the reward itself: null there (the trajectory's advantage, computed once). float64.
CREATE OR REPLACE TEMP TABLE turn_advantages AS
WITH r AS (
    SELECT rollout_id, prompt_id, turn_starts, turn_roles, turn_rewards,
           -- assistant turns, from turn_roles (imported trajectories have no `turns` column)
           len(list_filter(turn_roles, lambda x: x = 'assistant')) AS turns,
           coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, union_by_name = true)
), s AS (
    SELECT rollout_id, reward
    FROM read_parquet($score_files, union_by_name = true)
    WHERE reward IS NOT NULL AND NOT isnan(reward)
), earned AS (
    SELECT r.rollout_id, r.prompt_id, r.truncated, coalesce(r.turns, 1) AS n,
           list_concat(
               list_transform(list_slice(coalesce(r.turn_rewards, []), 1, coalesce(r.turns, 1) - 1), lambda x: coalesce(x, 0.0)),
               list_transform(range(coalesce(r.turns, 1) - 1 - len(coalesce(r.turn_rewards, []))), lambda x: 0.0)
           ) AS before_last,
           s.reward
    FROM r
    JOIN s USING (rollout_id)
    JOIN groups AS g ON g.prompt_id = r.prompt_id
    WHERE NOT (r.truncated AND $drop_truncated) AND g.dropped IS NULL
), turned AS (
    SELECT rollout_id, prompt_id, truncated,
           list_concat(before_last, [reward - coalesce(list_sum(before_last), 0.0)]) AS rs,
           unnest(range(1, n + 1)) AS k
    FROM earned
), returns AS (
    SELECT rollout_id, prompt_id, truncated, k,
           list_sum(list_transform(list_slice(rs, k, len(rs)), lambda x, i: x * pow($discount, i - 1))) AS ret
    FROM turned
), stats AS (
    SELECT prompt_id, k, count(*) AS n, min(ret) = max(ret) AS constant,
           list_sort(list(ret)) AS sorted
    FROM returns
    GROUP BY prompt_id, k
), adv AS (
    SELECT x.rollout_id, x.k,
        CASE
            WHEN st.n < 2 OR (x.k = 1 AND $discount = 1) THEN NULL
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
SELECT r.rollout_id, r.turn_starts, r.turn_roles, t.per_turn
FROM (SELECT rollout_id, list(a ORDER BY k) AS per_turn FROM adv GROUP BY rollout_id) AS t
JOIN r USING (rollout_id);
