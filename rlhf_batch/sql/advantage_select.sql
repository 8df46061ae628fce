-- advantage, step 5c (train.objective 'sft'; data/selection.py): the rows SFT trains on, as the
-- temp table `selected` (rollout_id; pair and chosen null), from `candidates`
-- (advantage_candidates.sql): those whose reward is at least $min_reward (advantage.select's
-- min_reward; null: any) and whose scored rollout satisfies advantage.select's `where` (the stage
-- writes it where `/* where */` stands: a predicate over `scored`, the rollouts columns joined
-- with the scores columns; `true` without one), then per prompt the $best of highest (reward,
-- then tie) (advantage.select's best; null: all).
--   $rollout_files, $score_files: the current iteration's parts
CREATE OR REPLACE TEMP TABLE selected AS
WITH scored AS (
    SELECT r.*, s.* EXCLUDE (rollout_id, prompt_id)
    FROM read_parquet($rollout_files, union_by_name = true) r
    JOIN read_parquet($score_files, union_by_name = true) s USING (rollout_id)
), k AS (
    SELECT rollout_id,
           row_number() OVER (PARTITION BY prompt_id ORDER BY reward DESC, tie, rollout_id) AS rank
    FROM candidates
    WHERE ($min_reward IS NULL OR reward >= $min_reward)
      AND rollout_id IN (SELECT rollout_id FROM scored WHERE (/* where */ true))
)
SELECT rollout_id, NULL::INTEGER AS pair, NULL::BOOLEAN AS chosen
FROM k
WHERE $best IS NULL OR rank <= $best;
