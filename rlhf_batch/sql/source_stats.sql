-- mixtures: per iteration and prompt source (the rollouts' `source` column of a weighted
-- generate.prompts; {source} is NULL when the run has none): prompts, rollouts, and over their
-- scores (every round; null and NaN left out) mean_score, mean_reward and pass_rate (score > {threshold}).
SELECT
    r.iter,
    {source} AS source,
    count(DISTINCT r.prompt_id) AS prompts,
    count(*) AS rollouts,
    avg(s.score) FILTER (WHERE NOT isnan(s.score)) AS mean_score,
    avg(s.reward) FILTER (WHERE NOT isnan(s.reward)) AS mean_reward,
    avg(CASE WHEN s.score > {threshold} THEN 1.0 ELSE 0.0 END) FILTER (WHERE NOT isnan(s.score)) AS pass_rate
FROM rollouts r
LEFT JOIN scores s USING (iter, topup, rollout_id)
GROUP BY ALL
