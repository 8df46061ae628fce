"""An iteration with no trainable row: train takes zero steps and carries the policy forward.

When the advantage stage leaves no row (every group filtered out, whatever the settings), its
manifest has 0 rows and says why (`no_trainable_rows`). Train then does not fail the run: it
copies the starting policy unchanged to `iter=K/policy` (the next iteration starts from the same
weights), carries the optimizer state of iteration K-1 unchanged to `iter=K/train/optimizer`
(same global step), writes an empty metrics.parquet and prints one warning line saying why.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from rlhf_batch.runtime import dist
from rlhf_batch.stages.train_carry import record
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

    from rlhf_batch.store.schemas import METRICS

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
    _copy_dir(run_path(start), policy, digest=True, base_copy=cfg.lora.enabled and not _has_adapter(start))
    atomic.write_parquet_atomic(sdir / layout.METRICS_FILE, METRICS.empty_table(), METRICS)
    return carried


def _has_adapter(start: str) -> bool:
    return (run_path(start) / layout.ADAPTER_DIR).is_dir()


def _copy_dir(src: Path, dst: Path, digest: bool = False, base_copy: bool = False) -> None:
    """A copy of `src` at `dst`; `digest`: a policy, with its weights' content hash (modeldir.py);
    `base_copy`: the LoRA base with no adapter yet, marked so the next train starts a fresh one."""
    from rlhf_batch.models.lora import BASE_COPY
    from rlhf_batch.store.modeldir import WEIGHTS_DIGEST, write_weights_digest

    def copy(tmp: Path) -> None:
        shutil.copytree(local_dir(src), tmp, dirs_exist_ok=True)
        if digest and not (tmp / WEIGHTS_DIGEST).is_file():
            write_weights_digest(tmp)
        if base_copy:
            (tmp / BASE_COPY).write_text('{"adapter": null}\n')

    atomic.write_dir_atomic(dst, copy)
