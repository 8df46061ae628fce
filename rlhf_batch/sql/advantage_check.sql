-- advantage, step 2, exact path: integrity of the pool of advantage_pool_joined.sql. One row;
-- each problem with a count and an example (iteration, rollout_id) so the error message can
-- name it.
SELECT
    count(*) FILTER (WHERE dup > 1) AS duplicate,
    arg_min(iter, rollout_id) FILTER (WHERE dup > 1) AS duplicate_iter,
    min(rollout_id) FILTER (WHERE dup > 1) AS duplicate_id,
    count(*) FILTER (WHERE in_rollouts AND NOT in_scores) AS unmatched_rollout,
    arg_min(iter, rollout_id) FILTER (WHERE in_rollouts AND NOT in_scores) AS unmatched_rollout_iter,
    min(rollout_id) FILTER (WHERE in_rollouts AND NOT in_scores) AS unmatched_rollout_id,
    count(*) FILTER (WHERE in_scores AND NOT in_rollouts) AS unmatched_score,
    arg_min(iter, rollout_id) FILTER (WHERE in_scores AND NOT in_rollouts) AS unmatched_score_iter,
    min(rollout_id) FILTER (WHERE in_scores AND NOT in_rollouts) AS unmatched_score_id,
    count(*) FILTER (WHERE in_scores AND in_rollouts AND prompt_mismatch) AS prompt_mismatch,
    arg_min(iter, rollout_id) FILTER (WHERE in_scores AND in_rollouts AND prompt_mismatch) AS prompt_mismatch_iter,
    min(rollout_id) FILTER (WHERE in_scores AND in_rollouts AND prompt_mismatch) AS prompt_mismatch_id,
    count(*) FILTER (WHERE isinf(reward)) AS infinite,
    arg_min(iter, rollout_id) FILTER (WHERE isinf(reward)) AS infinite_iter,
    min(rollout_id) FILTER (WHERE isinf(reward)) AS infinite_id
FROM (SELECT *, count(*) OVER (PARTITION BY iter, rollout_id) AS dup FROM pool);
