"""An iteration with no trainable row: train takes zero steps and carries the policy forward.

When the advantage stage leaves no row (every group filtered out, whatever the settings), its
manifest has 0 rows and says why (`no_trainable_rows`). Train then does not fail the run: it
copies the starting policy unchanged to `iter=K/policy` (the next iteration starts from the same
weights; `carried_from.json` there names the source, so score knows a policy carried forward
from the reference model is the reference: KL exactly 0), carries the optimizer state of iteration K-1 unchanged to `iter=K/train/optimizer`
(same global step), writes an empty metrics.parquet and prints one warning line saying why.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from rlhf_batch.runtime import dist
from rlhf_batch.stages.train.carry import record
from rlhf_batch.store import atomic, layout, manifests
from rlhf_batch.store.fs import local_dir, run_path


def carry_forward(
    cfg: Any,
    iteration: int,
    start: str,
    adv_dir: Path,
    prev: tuple[Path, dict[str, Any]] | None,
    sdir: Path,
    policy: Path,
) -> dict[str, Any]:
    """Rank 0 writes into the train folder `sdir` and the policy dir `policy`; returns the
    manifest's `optimizer` entry (the global step is unchanged)."""

    from rlhf_batch.store.schemas import METRICS, ROLLOUT_STATS

    step = int(prev[1]["global_step"]) if prev else 0
    total = prev[1].get("total_steps") if prev else None
    fresh = cfg.train.fresh_optimizer and iteration > 0
    carried = record(step, step, total, iteration - 1 if prev else None, fresh)
    if dist.rank_world()[0] != 0:
        return carried
    why = (manifests.manifest(adv_dir) or {}).get("no_trainable_rows") or "the advantages table has 0 rows"
    print(
        f"warning: iteration {iteration}: no trainable row ({why}); train took 0 steps and the "
        "policy is carried forward unchanged",
        file=sys.stderr,
        flush=True,
    )
    if prev is not None:
        _copy_dir(prev[0], sdir / layout.OPTIMIZER_DIR)
    _copy_policy(cfg, run_path(start), policy)
    atomic.write_parquet_atomic(sdir / layout.METRICS_FILE, METRICS.empty_table(), METRICS)
    atomic.write_parquet_atomic(sdir / layout.ROLLOUT_STATS_FILE, ROLLOUT_STATS.empty_table(), ROLLOUT_STATS)
    return carried


def _has_adapter(start: str) -> bool:
    return (run_path(start) / layout.ADAPTER_DIR).is_dir()


def _copy_policy(cfg: Any, src: Path, dst: Path) -> None:
    """The policy copied unchanged, with a record of its source (score/checks.origin: a policy
    carried forward from the reference is the reference, and gets KL exactly 0), its weights'
    content hash (modeldir.py) and, for the LoRA base with no adapter yet, a mark so the next
    train starts a fresh adapter."""
    from rlhf_batch.store.modeldir import carried_record, write_carried_from, write_weights_digest

    record = carried_record(src, dst)
    base_copy = cfg.lora.enabled and not _has_adapter(str(src))

    def write(tmp: Path) -> None:
        shutil.copytree(local_dir(src), tmp, dirs_exist_ok=True)
        write_carried_from(tmp, record)
        if not (tmp / layout.WEIGHTS_DIGEST).is_file():
            write_weights_digest(tmp)
        if base_copy:
            (tmp / layout.LORA_BASE_COPY).write_text('{"adapter": null}\n')

    atomic.write_dir_atomic(dst, write)


def _copy_dir(src: Path, dst: Path) -> None:
    atomic.write_dir_atomic(dst, lambda tmp: shutil.copytree(local_dir(src), tmp, dirs_exist_ok=True))
