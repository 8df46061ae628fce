-- advantage, step 2 (positional pool): rows that need the exact path (advantage_pool_joined.sql
-- and advantage_check.sql): not aligned by position, or a +/-inf reward. 0: the pool is good
-- (the duplicate check on `h` runs next).
SELECT count(*) FILTER (WHERE NOT aligned OR isinf(reward)) AS bad
FROM pool;
