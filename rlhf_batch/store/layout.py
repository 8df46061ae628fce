"""Every folder and file name of a run, in one place (no I/O here beyond listing a folder).

    RUN_DIR/.run.lock                                   held by `rlhf-batch run`
    RUN_DIR/iter=0003/<folder>/part-RRRRR-NNNNN.parquet (R = writing rank, N = part number)
    RUN_DIR/iter=0003/<folder>/_manifest.json           written last: the folder is complete
    RUN_DIR/iter=0003/<folder>/_started.json            identity of a run in progress
    RUN_DIR/iter=0003/policy/                           the policy train writes (HF model dir)
    RUN_DIR/iter=0003/train/metrics.parquet             train's metrics, one row per step
    RUN_DIR/iter=0003/train/rollout_stats.parquet       train's diagnostics, one row per rollout and epoch
    RUN_DIR/iter=0003/train/checkpoint/step-N/          train's checkpoints while it runs
    RUN_DIR/iter=0003/eval/part-RRRRR-NNNNN.parquet     held-out samples of the policy iteration 3 starts from
    RUN_DIR/iter=0003/policy/adapter/                   with [lora]: the adapter (lora.py)
    RUN_DIR/iter=0003/policy_removed.json               the policy was removed (keep_policies)
    RUN_DIR/init_policy/                                with lora.init_adapter: iteration 0's policy
    RUN_DIR/iter=0003/train/optimizer/                  AdamW state at the end of the iteration
    RUN_DIR/iter=0003/topup=01/rollouts/ (and scores/)  a top-up round of the iteration (topup.py)
    RUN_DIR/iter=0003/audit/part-RRRRR-NNNNN.parquet    the audit functions' verdicts (`rlhf-batch audit`)
    RUN_DIR/reward_cache/<function>/<source hash>/      the reward cache (rewards/cache.py)

A stage (a command: generate, import, score, advantage, train, eval) writes one folder (rollouts,
scores, advantages, train, eval); the unit of work and of resume inside a folder is a *part*.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.store.fs import run_path

MANIFEST = "_manifest.json"
STARTED = "_started.json"
LOCK = ".run.lock"
METRICS_FILE = "metrics.parquet"
ROLLOUT_STATS_FILE = "rollout_stats.parquet"  # train's per-rollout diagnostics
CHECKPOINT_DIR = "checkpoint"
OPTIMIZER_DIR = "optimizer"
POLICY_DIR = "policy"
ADAPTER_DIR = "adapter"  # inside a policy dir, with [lora]
POLICY_REMOVED = "policy_removed.json"  # iter=K/: what the removed policy was (retention.py)
ROLLOUTS, SCORES, ADVANTAGES, TRAIN, EVAL = "rollouts", "scores", "advantages", "train", "eval"
FOLDERS = (ROLLOUTS, SCORES, ADVANTAGES, TRAIN, EVAL)
AUDIT = "audit"  # written only by `rlhf-batch audit`, never by `run`


def iter_dir(run_dir: str | Path, it: int) -> Path:
    return run_path(run_dir) / f"iter={it:04d}"


def run_root(sdir: Path) -> Path | None:
    """The run directory that holds the stage folder `sdir` (the parent of its iter=K folder)."""
    for d in run_path(sdir).absolute().parents:  # a UPath is absolute already
        if d.name.startswith("iter="):
            return d.parent
    return None


STAGE_OF = {
    "rollouts": "generate",
    "scores": "score",
    "advantages": "advantage",
    "train": "train",
    "eval": "eval",
}


def redo_command(sdir: Path, stage: str = "") -> str:
    """The command that replaces the stage folder `sdir` (its stage command with --force; `run`
    has no --force): for the messages that tell a user how to start a stage over."""
    path = run_path(sdir)
    it = next((int(p[5:]) for p in reversed(path.parts) if p.startswith("iter=")), 0)
    top = next((int(p[6:]) for p in reversed(path.parts) if p.startswith("topup=")), 0)
    stage = stage or STAGE_OF.get(path.name, path.name)
    source = "FILE --config CONFIG" if stage == "import" else "CONFIG"
    return f"`rlhf-batch {stage} {source} --iter {it}{f' --topup {top}' if top else ''} --force`"


def folder(run_dir: str | Path, it: int, name: str, topup: int = 0) -> Path:
    """The output folder `name` (rollouts, scores, advantages, train, eval) of iteration `it`; of its
    top-up round `topup` when > 0 (rollouts and scores only)."""
    return iter_dir(run_dir, it) / (f"topup={topup:02d}" if topup else "") / name


def policy_dir(run_dir: str | Path, it: int) -> Path:
    """Where `train` of iteration `it` writes the new policy (a Hugging Face model dir)."""
    return iter_dir(run_dir, it) / POLICY_DIR


def init_policy_dir(run_dir: str | Path) -> Path:
    """With lora.init_adapter: the base model and that adapter, merged (iteration 0's policy)."""
    return run_path(run_dir) / "init_policy"


def checkpoint_dir(run_dir: str | Path, it: int) -> Path:
    return folder(run_dir, it, TRAIN) / CHECKPOINT_DIR


def optimizer_dir(run_dir: str | Path, it: int) -> Path:
    """The AdamW state (and global step) train of iteration `it` ended with; `it + 1` starts from it."""
    return folder(run_dir, it, TRAIN) / OPTIMIZER_DIR


def part_name(rank: int, n: int) -> str:
    return f"part-{rank:05d}-{n:05d}.parquet"


def part_number(path: Path) -> int:
    return int(path.stem.split("-")[2])


def list_parts(sdir: Path) -> list[Path]:
    """Finished parts on disk (temporary files are hidden and never match)."""
    return sorted(sdir.glob("part-*-*.parquet"), key=lambda p: (part_number(p), p.name))


def in_run(path: str | Path, run_dir: str | Path) -> str:
    """`path` as run files store it (the rollouts' `policy` column): relative to the run directory
    when it is inside it, so the run can be moved or copied; else as it is (absolute locally)."""
    text, root = str(path), str(run_dir).rstrip("/")
    if "://" in root or "://" in text:  # an object store: by name
        return text[len(root) + 1 :] if text.startswith(root + "/") else text
    p, r = Path(path).absolute(), Path(run_dir).absolute()
    for a, b in ((p, r), (p.resolve(), r.resolve())):
        if a.is_relative_to(b):
            return str(a.relative_to(b))
    return str(p)


def from_run(value: str, run_dir: str | Path) -> str:
    """A path stored by `in_run`, where it is now (a relative one below `run_dir`)."""
    if "://" in value or Path(value).is_absolute():
        return value
    return f"{str(run_dir).rstrip('/')}/{value}"


def portable(obj: Any, root: Path | None) -> Any:
    """`obj` with every path below the run directory `root` written as "{run_dir}/...": a run
    directory moved or copied elsewhere keeps the identities of its complete stages."""
    if root is None:
        return obj
    if isinstance(obj, dict):
        return {k: portable(v, root) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [portable(v, root) for v in obj]
    if isinstance(obj, str):
        prefix = str(root)
        if obj == prefix or obj.startswith(prefix + "/"):
            return "{run_dir}" + obj[len(prefix) :]
    return obj


def unportable(obj: Any, root: Path) -> Any:
    """`obj` with "{run_dir}" (portable) replaced by the run directory `root`."""
    if isinstance(obj, dict):
        return {k: unportable(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unportable(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith("{run_dir}"):
        return str(root) + obj[len("{run_dir}") :]
    return obj


def tmp_name(path: Path, pid: int) -> Path:
    """The hidden temporary name a file is written under before its rename."""
    return path.with_name(f".{path.name}.{pid}.tmp")


def staged(final: Path) -> Path:
    """Where a forced run of the folder `final` writes its output until it is swapped in."""
    return final.with_name(f".{final.name}.new")
