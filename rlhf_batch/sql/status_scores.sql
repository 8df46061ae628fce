-- status: headline numbers of one iteration's scores ($files: its parts). NaN counts as null.
SELECT
    avg(score) FILTER (WHERE NOT isnan(score)) AS mean_score,
    avg(reward) FILTER (WHERE NOT isnan(reward)) AS mean_reward,
    avg(kl_sum) AS mean_kl,
    count(*) FILTER (WHERE reward IS NULL OR isnan(reward)) AS unscored
FROM read_parquet($files, union_by_name = true);
