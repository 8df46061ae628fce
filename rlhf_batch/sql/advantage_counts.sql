-- advantage, step 5: what the filters did, for the manifest. Rows and groups of the current
-- iteration ($iter) only; `pooled_rows` are the older iterations' rows used in the statistics.
-- Row counts before the statistics come from `pool`, the per-filter ones from the groups'
-- n_current / n_current_truncated (no join of the rows with their groups).
WITH p AS (
    SELECT
        count(*) FILTER (WHERE iter = $iter) AS rows_in,
        count(*) FILTER (WHERE iter = $iter AND reward IS NULL) AS unscored,
        count(*) FILTER (WHERE iter = $iter AND reward IS NOT NULL AND truncated) AS truncated,
        count(*) FILTER (WHERE iter = $iter AND reward IS NOT NULL AND truncated AND NOT used)
            AS truncated_dropped,
        count(*) FILTER (WHERE iter <> $iter AND used) AS pooled_rows
    FROM pool
), g AS (
    SELECT
        coalesce(sum(n_current_truncated) FILTER (WHERE dropped IS NULL AND $zero_truncated), 0)
            AS truncated_zeroed,
        coalesce(sum(n_current) FILTER (WHERE dropped = 'small'), 0) AS rows_dropped_small,
        coalesce(sum(n_current) FILTER (WHERE dropped = 'zero_variance'), 0) AS rows_dropped_zero_variance,
        coalesce(sum(n_current) FILTER (WHERE dropped IS NULL), 0) AS rows_out,
        count(*) FILTER (WHERE current) AS groups_total,
        count(*) FILTER (WHERE current AND dropped = 'small') AS groups_dropped_small,
        count(*) FILTER (WHERE current AND dropped = 'zero_variance') AS groups_dropped_zero_variance,
        count(*) FILTER (WHERE current AND dropped IS NULL) AS groups_out
    FROM groups
)
SELECT
    rows_in, unscored, truncated, truncated_dropped, truncated_zeroed, rows_dropped_small,
    rows_dropped_zero_variance, rows_out, pooled_rows, groups_total, groups_dropped_small,
    groups_dropped_zero_variance, groups_out
FROM p, g;
