"""Train's per-rollout diagnostics: iter=K/train/rollout_stats.parquet (schemas.ROLLOUT_STATS).

One row per rollout and epoch that ran a forward pass: the `row_stats` of `grpo_loss`
(core.objectives.ROW_STATS) for that rollout, with its optimizer step. Kept on the device
during the stage (no host sync per micro-batch); every rank's rows are gathered on rank 0 at a
checkpoint and at the end. A checkpoint carries the rows so far, so a resumed train writes them
all.
"""

from __future__ import annotations

from typing import Any

from rlhf_batch.core.objectives import ROW_STATS
from rlhf_batch.runtime import dist

COUNTS = ("clipped_tokens", "masked_tokens")  # the integer columns of ROW_STATS


class RolloutStats:
    """This rank's rows since the start (or the checkpoint it resumed from)."""

    def __init__(self, restored: list[dict[str, Any]] | None = None):
        self.restored = list(restored or [])  # rank 0: the rows a checkpoint carried
        self.parts: list[tuple[list[int], int, int, Any]] = []  # (rows, epoch, step, [B, K] tensor)

    def add(self, rows: list[int], epoch: int, step: int, stats: Any) -> None:
        self.parts.append((list(rows), epoch, step, stats.detach()))

    def _local(self, rollout_ids: list[str], resp_lens: Any) -> list[dict[str, Any]]:
        import torch

        if not self.parts:
            return []
        values = torch.cat([p[3] for p in self.parts]).double().cpu().tolist()  # one copy to the host
        out, n = [], 0
        for rows, epoch, step, _ in self.parts:
            for i in rows:
                row = dict(zip(ROW_STATS, values[n], strict=True))
                row.update({k: int(row[k]) for k in COUNTS})
                nan = row["entropy_mean"] != row["entropy_mean"]
                row["entropy_mean"] = None if nan else row["entropy_mean"]
                out.append(
                    {
                        "rollout_id": rollout_ids[i],
                        "epoch": epoch,
                        "step": step,
                        "tokens": int(resp_lens[i]),
                        **row,
                    }
                )
                n += 1
        return out

    def gather(self, rollout_ids: list[str], resp_lens: Any) -> list[dict[str, Any]]:
        """Every rank's rows, on rank 0 (ordered by step, then rollout id); [] on the others."""
        mine = self._local(rollout_ids, resp_lens)
        rank, world = dist.rank_world()
        if world > 1 and dist.in_group():
            import torch.distributed as td

            parts: list[Any] = [None] * world if rank == 0 else []
            td.gather_object(mine, parts if rank == 0 else None, dst=0)
            mine = [r for p in parts for r in p] if rank == 0 else []
        if rank != 0:
            return []
        return sorted(self.restored + mine, key=lambda r: (r["step"], r["rollout_id"]))


def table(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    from rlhf_batch.store.schemas import ROLLOUT_STATS

    return pa.Table.from_pylist([{k: r[k] for k in ROLLOUT_STATS.names} for r in rows], schema=ROLLOUT_STATS)
