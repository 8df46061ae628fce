-- advantage, step 5: what the filters did, for the manifest. Rows and groups of the current
-- iteration ($iter) only; `pooled_rows` are the older iterations' rows used in the statistics.
SELECT
    count(*) FILTER (WHERE p.iter = $iter) AS rows_in,
    count(*) FILTER (WHERE p.iter = $iter AND p.reward IS NULL) AS unscored,
    count(*) FILTER (WHERE p.iter = $iter AND p.reward IS NOT NULL AND p.truncated) AS truncated,
    count(*) FILTER (WHERE p.iter = $iter AND p.reward IS NOT NULL AND p.truncated AND NOT p.used)
        AS truncated_dropped,
    count(*) FILTER (WHERE p.iter = $iter AND p.used AND p.truncated AND g.dropped IS NULL AND $zero_truncated)
        AS truncated_zeroed,
    count(*) FILTER (WHERE p.iter = $iter AND p.used AND g.dropped = 'small') AS rows_dropped_small,
    count(*) FILTER (WHERE p.iter = $iter AND p.used AND g.dropped = 'zero_variance')
        AS rows_dropped_zero_variance,
    count(*) FILTER (WHERE p.iter = $iter AND p.used AND g.dropped IS NULL) AS rows_out,
    count(*) FILTER (WHERE p.iter <> $iter AND p.used) AS pooled_rows,
    (SELECT count(*) FROM groups WHERE current) AS groups_total,
    (SELECT count(*) FROM groups WHERE current AND dropped = 'small') AS groups_dropped_small,
    (SELECT count(*) FROM groups WHERE current AND dropped = 'zero_variance') AS groups_dropped_zero_variance,
    (SELECT count(*) FROM groups WHERE current AND dropped IS NULL) AS groups_out
FROM pool AS p
LEFT JOIN groups AS g USING (prompt_id);
