-- advantage, step 6: the training rows of the current iteration ($iter), in part order.
--   $rollout_files, $score_files: the current iteration's parts only
--   $estimator ('grpo' | 'drgrpo' | 'rloo'; 'opd' computes the group part as 'grpo'), $scale ('group' | 'batch' | 'none'), $eps,
--   $batch_std, $zero_truncated (advantage.truncated = 'zero'), $drop_truncated
--   (advantage.truncated = 'drop'), $bucket_tokens, $seed
-- Rows: the current iteration's rollouts with a reward that enter the statistics (`used` of
-- advantage_pool.sql, recomputed here: NaN is no reward) and whose group is kept.
-- Advantages (float64, stored as float32), with mean/std/n from `groups`:
--   constant group -> 0 exactly; truncated row with truncated = 'zero' -> 0;
--   rloo   -> n / (n - 1) * (r - mean)    (= r minus the mean of the others)
--   drgrpo, or grpo with scale 'none' -> r - mean
--   grpo   -> (r - mean) / (std + eps), std = the group's std or $batch_std
-- Order: bucket b = len(input_ids) // $bucket_tokens; buckets sorted by
-- md5_number('{seed}:{iter}:bucket:{b}') (a seeded shuffle), rows within a bucket by
-- md5_number('{seed}:{iter}:row:{rollout_id}'); b and rollout_id break ties (total order).
-- With estimator 'opd' the stage replaces each `/* teacher_logprobs */` by `teacher_logprobs,`
-- (the scores' extra column, absent without a teacher) and adds the per-token advantages in
-- Python (stages/advantage.token_advantages); the query of the other estimators is this text.
-- `signal` is what the advantage is of: the reward; with advantage.reward_normalization =
-- 'per_part' the stage joins the GDPO sum of the normalised parts instead (table `gdpo`,
-- advantage_parts.sql), and `reward` stays the row's reward.
-- An iteration train.objective trains with 'sft' or 'dpo' (data/selection.py): the stage
-- replaces `/* selected */` by a join with the temp table `selected`, and for 'dpo' also
-- `/* c.pair */` by `c.pair, c.chosen,` and `/* pair order */` by `pair, chosen DESC,` (a row
-- per pair it is in, in pair order); for 'grpo' the query is this text.
-- Multi-turn rollouts (a `loss_mask` column in a rollouts part): the stage replaces
-- `/* loss_mask */` by `loss_mask,` and `/* r.loss_mask */` by `r.loss_mask,` (null in a part
-- without the column: all ones); without one the query is this text.
WITH r AS (
    SELECT rollout_id, prompt_id, prompt_ids, response_ids, behavior_logprobs, /* loss_mask */
           coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, union_by_name = true)
), s AS (
    SELECT rollout_id, /* teacher_logprobs */ ref_logprobs, reward, reward AS signal
    FROM read_parquet($score_files, union_by_name = true)
    WHERE reward IS NOT NULL AND NOT isnan(reward)
), rows AS (
    SELECT
        r.rollout_id,
        r.prompt_id,
        list_concat(r.prompt_ids, r.response_ids) AS input_ids,
        len(r.prompt_ids)::INTEGER AS prompt_len,
        r.behavior_logprobs,
        /* teacher_logprobs */ s.ref_logprobs,
        /* r.loss_mask */
        /* c.pair */
        CAST(CASE
            WHEN g.constant THEN 0.0
            WHEN r.truncated AND $zero_truncated THEN 0.0
            WHEN $estimator = 'rloo' THEN (s.signal - g.mean) * g.n / (g.n - 1)
            WHEN $estimator = 'drgrpo' OR $scale = 'none' THEN s.signal - g.mean
            WHEN $scale = 'batch' THEN (s.signal - g.mean) / ($batch_std + $eps)
            ELSE (s.signal - g.mean) / (g.std + $eps)
        END AS FLOAT) AS advantage,
        s.reward,
        g.n::INTEGER AS group_size,
        g.mean AS group_mean,
        g.std AS group_std,
        (len(r.prompt_ids) + len(r.response_ids)) // $bucket_tokens AS bucket
    FROM r
    JOIN s USING (rollout_id)
    JOIN groups AS g ON g.prompt_id = r.prompt_id
    /* selected */
    WHERE NOT (r.truncated AND $drop_truncated) AND g.dropped IS NULL
)
SELECT * EXCLUDE (bucket)
FROM rows
ORDER BY
    /* pair order */
    md5_number(concat_ws(':', $seed, $iter, 'bucket', bucket)),
    bucket,
    md5_number(concat_ws(':', $seed, $iter, 'row', rollout_id)),
    rollout_id;
