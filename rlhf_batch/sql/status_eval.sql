-- status: headline numbers of one iteration's held-out evaluation ($files: its parts).
SELECT
    avg(reward) FILTER (WHERE NOT isnan(reward)) AS mean_reward,
    avg(correct::DOUBLE) AS correct,
    avg(len(response_ids)) AS mean_response_len
FROM read_parquet($files, union_by_name = true);
