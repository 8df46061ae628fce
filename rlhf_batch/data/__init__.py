"""L3, prompt data: prompt sets (datasets dirs, JSONL, JSON, Parquet), their batches and top-up
order, and the demo task's assets."""
