-- status: headline numbers of one iteration's train metrics ($files: metrics.parquet).
SELECT
    arg_max(loss, step) AS final_loss,
    avg(kl_to_ref) AS mean_kl_to_ref,
    avg(clip_fraction) AS mean_clip_fraction
FROM read_parquet($files, union_by_name = true);
