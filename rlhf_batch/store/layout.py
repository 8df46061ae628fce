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

docs/on-disk.md lists every file (the run-level records, the files inside a policy dir, the
temporary names); tests/store/test_layout.py checks it against a finished run.

Temporary names: a file or folder is written under `tmp_name` (hidden, `.NAME.PID.tmp`) and
renamed; `is_tmp` recognises it, and the folders older versions wrote (`.NAME.tmp-PID`), so a
leftover of a killed writer of either version is found and removed (`leftovers`).

A stage (a command: generate, import, score, advantage, train, eval, audit) writes one folder
(rollouts, scores, advantages, train, eval, audit); the unit of work and of resume inside a folder is a *part*.
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
POLICY_TRASH = ".policy.removed-"  # iter=K/.policy.removed-NS: a policy being removed (retention.py)
INIT_POLICY_DIR = "init_policy"  # RUN_DIR/: with lora.init_adapter, iteration 0's policy
SCHEDULE = "schedule.json"  # RUN_DIR/: the LR schedule's length, fixed once per run (train_schedule.py)
BASE_WEIGHTS = "base_weights.json"  # RUN_DIR/: the initial policy's and reference's weights, hashed once
WEIGHTS_DIGEST = "weights_digest.json"  # in a policy dir this package wrote: sha256 of its weights
CARRIED_FROM = "carried_from.json"  # in a policy dir train copied unchanged: {"from", "fingerprint"}
LORA_BASE_COPY = "lora_base_copy.json"  # in a policy dir: the LoRA base carried forward (no adapter yet)
INIT_ADAPTER = "init_adapter.json"  # in RUN_DIR/init_policy: which adapter it was made from
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # in policy/adapter/ (peft's names)
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"  # in train/optimizer/ (models/optim_state.py)
OPTIMIZER_META = "optimizer.json"
CHECKPOINT_PREFIX = "step-"  # train/checkpoint/step-N/ (models/checkpoint.py)
CHECKPOINT_STATE, CHECKPOINT_RNG = "state.json", "rng.safetensors"  # in step-N/, beside the weights
STAGED, RETIRED = ".new", ".old"  # iter=K/.NAME.new/ under --force, .NAME.old/ during the swap (staging.py)
REPORT_DIR, REPORT_PAGE, REPORT_SUMMARY = "report", "report.html", "summary.json"  # RUN_DIR/report/
TRACKING_DIR = "tracking"  # RUN_DIR/tracking/: report_to's local files (observe/tracking.py)
DUCKDB_SPILL = ".duckdb.tmp"  # RUN_DIR/.duckdb.tmp/: advantage's DuckDB spills while it runs
ITER_GLOB, TOPUP_GLOB = "iter=*", "topup=*"  # every iteration folder, every top-up round folder
PART_GLOB = "part-*-*.parquet"  # every finished part
ROLLOUTS, SCORES, ADVANTAGES, TRAIN, EVAL = "rollouts", "scores", "advantages", "train", "eval"
AUDIT = "audit"  # written only by `rlhf-batch audit`, never by `run`
FOLDERS = (ROLLOUTS, SCORES, ADVANTAGES, TRAIN, EVAL, AUDIT)  # every stage's output folder
REWARD_CACHE = "reward_cache"  # RUN_DIR/reward_cache/: score.reward_cache's verdicts (rewards/cache.py)
TURNS_DIR = "turns"  # rollouts/turns/: multi-turn generate's per-part turn checkpoints (stages/multiturn.py)


ITER_PREFIX, TOPUP_PREFIX = "iter=", "topup="


def iter_name(it: int) -> str:
    """The folder of iteration `it` (iter=0003), as the run dir and the advantage inputs name it."""
    return f"{ITER_PREFIX}{it:04d}"


def topup_name(topup: int) -> str:
    """The folder of top-up round `topup` inside an iteration folder (topup=01)."""
    return f"{TOPUP_PREFIX}{topup:02d}"


def iter_dir(run_dir: str | Path, it: int) -> Path:
    return run_path(run_dir) / iter_name(it)


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


def redo_from_command(sdir: Path, stage: str = "") -> str:
    """`rlhf-batch run CONFIG --redo-from K:STAGE` for the stage folder `sdir` (store/redo.py)."""
    path = run_path(sdir)
    it = next((int(p[5:]) for p in reversed(path.parts) if p.startswith("iter=")), 0)
    stage = stage or STAGE_OF.get(path.name, path.name)
    return f"`rlhf-batch run CONFIG --redo-from {it}:{stage}`"


def folder(run_dir: str | Path, it: int, name: str, topup: int = 0) -> Path:
    """The output folder `name` (rollouts, scores, advantages, train, eval) of iteration `it`; of its
    top-up round `topup` when > 0 (rollouts and scores only)."""
    return iter_dir(run_dir, it) / (topup_name(topup) if topup else "") / name


def policy_dir(run_dir: str | Path, it: int) -> Path:
    """Where `train` of iteration `it` writes the new policy (a Hugging Face model dir)."""
    return iter_dir(run_dir, it) / POLICY_DIR


def init_policy_dir(run_dir: str | Path) -> Path:
    """With lora.init_adapter: the base model and that adapter, merged (iteration 0's policy)."""
    return run_path(run_dir) / INIT_POLICY_DIR


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
    return sorted(sdir.glob(PART_GLOB), key=lambda p: (part_number(p), p.name))


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
    """The hidden temporary name a file or folder is written under (by process `pid`) before
    its rename."""
    return path.with_name(f".{path.name}.{pid}.tmp")


def staged(final: Path) -> Path:
    """Where a forced run of the folder `final` writes its output until it is swapped in."""
    return final.with_name(f".{final.name}{STAGED}")


def is_tmp(name: str) -> bool:
    """Whether `name` is a temporary name: `tmp_name`'s, or `.NAME.tmp-PID`, the name older
    versions wrote folders under (a leftover of their killed writers is still found)."""
    if not name.startswith("."):
        return False
    return name.endswith(".tmp") or name.rpartition(".tmp-")[2].isdigit()


def leftovers(parent: Path, name: str = "*") -> list[Path]:
    """The temporary files and folders in `parent` (of the final name `name`, default any): what
    a killed writer left."""
    return sorted(p for p in parent.glob(f".{name}.*") if is_tmp(p.name))
