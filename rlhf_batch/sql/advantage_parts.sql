-- advantage, step 2 (advantage.reward_normalization = 'per_part', GDPO): per pooled row, the sum
-- over reward_raw's parts (the scores manifest's `reward_parts`: column -> weight) of
--   weight x (part - the group's mean of the part) / (the group's std of the part + $eps),
-- a part constant in its group giving 0 exactly (as a constant group's advantage does). The
-- group is the prompt's used rows in the pool (a reward, and not truncated when $drop_truncated),
-- as for the other statistics; TRL's multi_objective_aggregation = "normalize_then_sum" (with
-- advantage.scale = "batch" and eps = 1e-4, its constant, for its batch normalisation after the sum).
-- The stage writes the part columns where `/* parts */` stands, their sorted lists per group where
-- `/* lists */` stands and the weighted terms where `/* signal */` stands (list_stddev_samp or
-- _pop by advantage.ddof); sorted lists: the statistics do not depend on thread scheduling.
--   $rollout_files, $score_files: the pooled parts (hive paths, iter=K); $eps; $drop_truncated
CREATE OR REPLACE TEMP TABLE gdpo AS
WITH r AS (
    SELECT iter, rollout_id, coalesce(finish_reason = 'length', false) AS truncated
    FROM read_parquet($rollout_files, hive_partitioning = true, hive_types = {'iter': INTEGER},
                      union_by_name = true)
), u AS (
    SELECT s.iter, s.rollout_id, s.prompt_id, /* parts */ hash(s.iter, s.rollout_id) AS h
    FROM read_parquet($score_files, hive_partitioning = true, hive_types = {'iter': INTEGER},
                      union_by_name = true) AS s
    JOIN r ON r.iter = s.iter AND r.rollout_id = s.rollout_id
    WHERE s.reward IS NOT NULL AND NOT isnan(s.reward) AND NOT (r.truncated AND $drop_truncated)
), t AS (
    SELECT prompt_id, /* lists */ count(*) AS n
    FROM u
    GROUP BY prompt_id
)
SELECT u.iter, u.rollout_id, u.h, /* signal */ AS signal
FROM u JOIN t USING (prompt_id);
