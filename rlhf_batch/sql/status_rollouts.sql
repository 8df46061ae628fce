-- status: headline numbers of one iteration's rollouts ($files: its parts).
SELECT
    avg(len(response_ids)) AS mean_response_len,
    avg((finish_reason = 'length')::DOUBLE) AS truncated
FROM read_parquet($files, union_by_name = true);
