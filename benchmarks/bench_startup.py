"""Start-up: `rlhf-batch --help`, and each stage command's wall time on a tiny run.

A stage's start-up to its first batch is bounded above by the wall time of the whole command
(fresh process: imports, config, model load, one batch, writes) on a run whose work is one
tiny batch: the tiny 2-layer model, 2 prompts x 2 samples, 2 new tokens. Best of 5 runs for
--help, one run per stage command (the order of the pipeline), and the "import floor": a fresh
process that only imports torch, transformers' Qwen2 modelling and AutoTokenizer.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import append_row, model_dir  # noqa: E402

CLI = Path(sys.executable).parent / "rlhf-batch"
# what every model-loading stage imports before its first batch, whatever it does: the floor
IMPORTS = "import torch, transformers.models.qwen2.modeling_qwen2; from transformers import AutoTokenizer"


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def config(tmp: Path) -> Path:
    from rlhf_batch.data.demo import write_prompts

    prompts = write_prompts(tmp / "prompts.jsonl", 2, seed=0)
    path = tmp / "config.toml"
    path.write_text(
        f'run_dir = "{tmp / "run"}"\npolicy_model = "{model_dir(True)}"\ndevice = "cpu"\ndtype = "float32"\n'
        f'[generate]\nprompts = "{prompts}"\nnum_generations = 2\nmax_new_tokens = 2\n'
        '[score]\nreward_functions = ["rlhf_batch.rewards.demo:letter_count"]\n'
        "[advantage]\ndrop_zero_variance = false\nmin_group_size = 1\n"
    )
    return path


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    helps = [wall([str(CLI), "--help"]) for _ in range(1 if args.tiny else 5)]
    append_row(
        args.results,
        "cli --help",
        "fresh process",
        "wall time (best of runs)",
        f"{min(helps):.2f}s",
        target="< 0.5 s",
        met=min(helps) < 0.5,
    )
    common.CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        cfg = config(Path(tmp))
        stages = ("generate", "score") if args.tiny else ("generate", "score", "advantage", "train")
        times = {s: wall([str(CLI), s, str(cfg), "--iter", "0", "-q"]) for s in stages}
    text = ", ".join(f"{s} {t:.1f}s" for s, t in times.items())
    if not args.tiny:
        text += f"; import floor {wall([sys.executable, '-c', IMPORTS]):.1f}s"
    worst = max(times["generate"], times["score"])
    append_row(
        args.results,
        "stage start-up",
        "tiny model, 2 prompts x 2 samples, 2 new tokens",
        "whole command wall time (upper bound of start-up to first batch)",
        text,
        target="< 3 s (generate, score)",
        met=worst < 3,
    )


if __name__ == "__main__":
    main()
