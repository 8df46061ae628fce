-- curriculum: per-prompt history over the relation `scores` (columns prompt_id, score, iter; every
-- round of the iterations it holds). attempts: the rollouts with a score (null and NaN: not
-- attempts); mean_score; pass_rate: the share of those with score > {threshold}; last_iter: the
-- last iteration that sampled the prompt. {threshold} is a float literal (generate.pass_threshold).
SELECT
    prompt_id,
    count(*) AS attempts,
    avg(score) AS mean_score,
    avg(CASE WHEN score > {threshold} THEN 1.0 ELSE 0.0 END) AS pass_rate,
    max(iter)::INTEGER AS last_iter
FROM scores
WHERE score IS NOT NULL AND NOT isnan(score)
GROUP BY prompt_id
