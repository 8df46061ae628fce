-- advantage, step 5c (train.objective 'dpo'; data/selection.py): the preference pairs, as the
-- temp table `selected`: two rows per pair, (rollout_id, pair, chosen) for its chosen row (true)
-- and its rejected row (false), from `candidates` (advantage_candidates.sql). Per prompt, a pair
-- is two rows whose rewards differ by more than $margin (advantage.pair_margin), the higher one
-- chosen: with $all (advantage.pairs = 'all') every such two rows; else ('best_worst') only its
-- first row in (reward desc, tie) against its first in (reward asc, tie). A prompt whose rewards
-- are all equal has no pair.
-- `pair` numbers the pairs 0, 1, ... in the order train reads them: buckets of the longer row's
-- length // $bucket_tokens in a seeded shuffled order (md5 of '{seed}:{iter}:bucket:{b}', as
-- advantage_rows.sql orders rows), pairs inside a bucket by md5 of
-- '{seed}:{iter}:pair:{chosen_id}:{rejected_id}'; the ids break ties (a total order).
CREATE OR REPLACE TEMP TABLE selected AS
WITH o AS (
    SELECT *,
           row_number() OVER (PARTITION BY prompt_id ORDER BY reward DESC, tie, rollout_id) AS hi,
           row_number() OVER (PARTITION BY prompt_id ORDER BY reward ASC, tie, rollout_id) AS lo
    FROM candidates
), p AS (
    SELECT a.rollout_id AS chosen_id, b.rollout_id AS rejected_id,
           greatest(a.length, b.length) // $bucket_tokens AS bucket
    FROM o AS a
    JOIN o AS b ON a.prompt_id = b.prompt_id AND a.reward - b.reward > $margin
    WHERE $all OR (a.hi = 1 AND b.lo = 1)
), n AS (
    SELECT *,
           (row_number() OVER (ORDER BY md5_number(concat_ws(':', $seed, $iter, 'bucket', bucket)), bucket,
                               md5_number(concat_ws(':', $seed, $iter, 'pair', chosen_id, rejected_id)),
                               chosen_id, rejected_id) - 1)::INTEGER AS pair
    FROM p
)
SELECT chosen_id AS rollout_id, pair, true AS chosen FROM n
UNION ALL
SELECT rejected_id AS rollout_id, pair, false AS chosen FROM n;
