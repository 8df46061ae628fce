-- health: one row per trained iteration, its train diagnostics against the thresholds below
-- (docs/inspecting.md "Run health" gives their sources). Reads the `metrics` view: one row per optimizer
-- step; a step that ran no token has null token means and ESS and is left out of them. {tis_masked}: the
-- column, or NULL for metrics written before it existed (health.create_view). {sequence_iters}: the
-- iterations trained with train.ratio_level = 'sequence' (GSPO), whose clip fraction counts whole rows
-- clipped at GSPO's own range and is not held to the token-level PPO threshold.
WITH limits AS (  -- health.THRESHOLDS, written in by health.view_sql()
    SELECT
        {clip_fraction} AS clip_limit,         -- median clip fraction of the iteration's steps above this
        {ess} AS ess_limit,                    -- a step's ESS below this ...
        {low_ess_share} AS low_ess_limit,      -- ... on more than this share of the iteration's steps
        {entropy_fall} AS entropy_fall_limit,  -- mean entropy below (1 - this) x the previous iteration's
        {kl_approx} AS kl_limit                -- a step's kl_approx (KL old -> current, k3) above this
),
per_iter AS (
    SELECT
        iter,
        count(*) AS steps,
        median(clip_fraction) AS clip_fraction,
        avg((ess < (SELECT ess_limit FROM limits))::DOUBLE) AS low_ess_share,
        avg(entropy) AS entropy,
        max(kl_approx) AS kl_approx_max,
        avg({tis_masked}) AS tis_masked        -- mean share of tokens the importance-sampling mask dropped
    FROM metrics
    GROUP BY iter
),
checked AS (
    SELECT
        p.*,
        p.entropy / lag(p.entropy) OVER (ORDER BY p.iter) - 1 AS entropy_change,
        p.clip_fraction > l.clip_limit AND NOT list_contains({sequence_iters}, p.iter) AS clip_flag,
        p.low_ess_share > l.low_ess_limit AS ess_flag,
        p.kl_approx_max > l.kl_limit AS kl_flag,
        l.*
    FROM per_iter p, limits l
)
SELECT
    iter, steps, clip_fraction, low_ess_share, entropy, entropy_change, kl_approx_max, tis_masked,
    [f FOR f IN [
        CASE WHEN clip_flag THEN 'clip_fraction' END,
        CASE WHEN ess_flag THEN 'ess' END,
        CASE WHEN entropy_change < -entropy_fall_limit THEN 'entropy_fall' END,
        CASE WHEN kl_flag THEN 'kl_spike' END
    ] IF f IS NOT NULL] AS flags,
    concat_ws('; ',
        CASE WHEN clip_flag THEN printf('median clip_fraction %.2f > %.2f', clip_fraction, clip_limit) END,
        CASE WHEN ess_flag THEN printf('ESS < %.1f on %.0f%% of steps (> %.0f%%)', ess_limit,
                                       100 * low_ess_share, 100 * low_ess_limit) END,
        CASE WHEN entropy_change < -entropy_fall_limit THEN printf('entropy fell %.0f%% (> %.0f%%) to %.3g',
                                       -100 * entropy_change, 100 * entropy_fall_limit, entropy) END,
        CASE WHEN kl_flag THEN printf('kl_approx spiked to %.3g (> %.2g)', kl_approx_max, kl_limit) END
    ) AS warning
FROM checked
ORDER BY iter
