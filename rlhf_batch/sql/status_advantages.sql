-- status: headline numbers of one iteration's training parts ($files).
SELECT
    count(DISTINCT prompt_id) AS groups,
    avg(reward) AS mean_reward,
    avg(abs(advantage)) AS mean_abs_advantage
FROM read_parquet($files, union_by_name = true);
