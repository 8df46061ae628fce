-- advantage, step 5b (an iteration train.objective trains with 'sft' or 'dpo'; data/selection.py):
-- the rows the objective may learn from, as the temp table `candidates`: the current
-- iteration's rows with a reward (NaN is none), not dropped as truncated ($drop_truncated), and,
-- where the stage writes `JOIN groups ... dropped IS NULL` in place of `/* kept */`, whose group the
-- filters keep (advantage_groups.sql): the training rows advantage_rows.sql would write.
-- `export --pairs` builds it with `/* kept */` left as it is: every scored row.
--   reward: the scores' reward; length: prompt + response tokens; tie: md5 of
--   '{seed}:{iter}:select:{rollout_id}', which orders rows of equal reward (a seeded, fixed choice).
--   $rollout_files, $score_files: the current iteration's parts; $seed, $iter
CREATE OR REPLACE TEMP TABLE candidates AS
WITH r AS (
    SELECT rollout_id, prompt_id, len(prompt_ids) + len(response_ids) AS length,
           coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, union_by_name = true)
), s AS (
    SELECT rollout_id, reward
    FROM read_parquet($score_files, union_by_name = true)
    WHERE reward IS NOT NULL AND NOT isnan(reward)
)
SELECT r.rollout_id, r.prompt_id, s.reward, r.length,
       md5_number(concat_ws(':', $seed, $iter, 'select', r.rollout_id)) AS tie
FROM r
JOIN s USING (rollout_id)
/* kept */
WHERE NOT (r.truncated AND $drop_truncated);
