-- advantage, step 4 (scale = 'batch' only): the std (given $ddof) of every reward that enters
-- the statistics, around the batch mean (not pooled within groups); 0 when all are equal.
-- It is taken before the group filters, like the core reference over the same rows.
SELECT CASE
    WHEN count(*) <= $ddof OR min(reward) = max(reward) THEN 0.0
    WHEN $ddof = 1 THEN stddev_samp(reward ORDER BY reward)
    ELSE stddev_pop(reward ORDER BY reward)
END AS batch_std
FROM pool
WHERE used;
