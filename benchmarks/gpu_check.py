"""The GPU check: one command on a GPU machine where a CUDA PyTorch is installed and the network is not.

    make wheels            # here, with a network: the project and its runtime dependencies but torch
    make gpu-check         # there: python benchmarks/gpu_check.py --wheels wheels (at most ~8 min)
    python benchmarks/gpu_check.py --device cpu --shape tiny --no-install   # the same path on a CPU

It installs the project from the wheel folder, offline, into a venv that sees the machine's torch
(`--venv`, default .venv-gpu), builds a Qwen2.5-0.5B-shaped random policy and reference with
`rlhf-batch init-model --shape`, and runs one iteration of every stage in bf16: generate (the hf
engine, and vLLM when it imports), score with the reference model and KL, advantage, train plain
and with FSDP2 on one rank under torchrun, eval. It prints and writes (OUT/gpu_check.json and .md)
tokens/s per stage, peak GPU memory, bf16 utilisation against the device's measured matmul peak,
and the numerics of a small slice against CPU float32 (gpu_numerics.py). Any failure (a stage's
error, a torch outside the range pyproject accepts, a tolerance) exits 1 naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# per shape: prompts per iteration, samples per prompt, max new tokens, eval prompts, numerics rows
SIZES = {
    "qwen2.5-0.5b": {"prompts": 64, "g": 8, "new": 64, "eval": 32, "slice": 8, "peak_n": 8192},
    "tiny": {"prompts": 8, "g": 4, "new": 8, "eval": 4, "slice": 4, "peak_n": 512},
}
# the stage folder each step's manifest is in (iteration 0; eval of iteration 1's starting policy)
FOLDERS = {"generate": "iter=0000/rollouts", "score": "iter=0000/scores", "advantage": "iter=0000/advantages"}
FOLDERS |= {"train": "iter=0000/train", "train_fsdp": "iter=0000/train", "eval": "iter=0001/eval"}
FOLDERS |= {"generate_vllm": "iter=0000/rollouts"}
PASSES = {"generate": 1, "generate_vllm": 1, "score": 1, "eval": 1, "train": 3, "train_fsdp": 3}  # fwd = 1


class Failure(Exception):
    """A step of the check failed; the message names it."""


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """`rlhf-batch ARGS` in a fresh process; its stdout, or Failure with its stderr's tail."""
    return _run([sys.executable, "-m", "rlhf_batch", *args], f"rlhf-batch {args[0]}", env, timeout)


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    p = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
    )
    if p.returncode != 0:
        raise Failure(f"{what} failed (exit {p.returncode}):\n{(p.stderr or p.stdout)[-3000:]}")
    return p.stdout


def install(args: argparse.Namespace, script: str = __file__) -> int:
    """Install the project from --wheels into --venv (offline), then run `script` (this check, or
    another benchmark sharing these arguments: gpu_bench.py) there with --no-install."""
    venv, wheels = Path(args.venv), str(args.wheels)
    py = str(venv / "bin" / "python")
    if not Path(py).exists():
        make_venv(venv)
    wheel = sorted(Path(wheels).glob("rlhf_batch-*.whl"))
    if not wheel:
        raise Failure(f"--wheels {wheels}: no rlhf_batch wheel there (make wheels)")
    pip = [py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheels]
    _run([*pip, str(wheel[-1])], f"pip install from {wheels} (offline)")
    _run([*pip, "--no-deps", "--force-reinstall", str(wheel[-1])], "pip install of the project's wheel")
    rest = [a for a in sys.argv[1:] if a not in ("--wheels", wheels)]
    return subprocess.run([py, script, "--no-install", *rest]).returncode


def make_venv(venv: Path) -> None:
    """A venv that sees this Python's packages (its torch, its pip) behind its own: a .pth file
    lists this interpreter's site-packages, wherever they are (system, conda or another venv, which
    `--system-site-packages` would miss), so what pip installs there comes first. It is made
    without pip (a Python without ensurepip can make it too): this Python's pip, seen through the
    .pth, installs into it."""
    import site

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "venv")
    purelib = _run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        "venv",
    )
    host = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    Path(purelib.strip(), "gpu_check_host.pth").write_text("\n".join(host) + "\n")


def worker(peak_file: str, argv: list[str]) -> None:
    """A stage command in this process; at exit its peak GPU memory and RSS go to `peak_file`."""
    import atexit
    import resource

    def record() -> None:
        torch = sys.modules.get("torch")  # not imported by a stage without a model (advantage)
        gpu = torch.cuda.max_memory_allocated() if torch and torch.cuda.is_initialized() else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(peak_file).write_text(json.dumps({"peak_gpu_bytes": gpu, "max_rss_bytes": rss}))

    atexit.register(record)
    sys.argv = ["rlhf-batch", *argv]
    from rlhf_batch.commands.cli import main

    main()


def check_torch(device: str) -> dict[str, Any]:
    """The torch here: in the range pyproject accepts, and with CUDA when --device cuda."""
    from importlib.metadata import requires

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    spec = next(
        Requirement(r).specifier for r in requires("rlhf-batch") or [] if Requirement(r).name == "torch"
    )
    facts = {"torch": torch.__version__, "accepted": str(spec), "cuda": torch.version.cuda}
    if Version(Version(torch.__version__).base_version) not in spec:
        raise Failure(f"torch {torch.__version__}: outside the range rlhf-batch accepts ({spec})")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise Failure(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        facts["device_name"] = torch.cuda.get_device_name(0)
    return facts


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    """Policy and reference models, prompts and the config of the run."""
    size = SIZES[args.shape]
    for name, seed in (("policy", 0), ("reference", 1)):  # another random model: a real KL
        cli("init-model", str(work / name), "--shape", args.shape, "--seed", str(seed))
    cli("init-prompts", str(work / "prompts.jsonl"), "--n", str(size["prompts"]))
    cli("init-prompts", str(work / "eval.jsonl"), "--n", str(size["eval"]), "--seed", "1")
    toml = f"""run_dir = "{work / "run"}"
policy_model = "{work / "policy"}"
ref_model = "{work / "reference"}"
device = "{args.device}"
dtype = "bfloat16"
seed = 0
[generate]
prompts = "{work / "prompts.jsonl"}"
num_generations = {size["g"]}
prompts_per_iteration = {size["prompts"]}
max_new_tokens = {size["new"]}
batch_size = {size["prompts"] * size["g"]}
[score]
reward_functions = ["gpu_check:spread"]
reward_paths = ["{HERE}"]
kl_in_reward = true
[train]
lr = 1e-5
sequences_per_step = {size["prompts"] * size["g"] // 4}
[eval]
prompts = "{work / "eval.jsonl"}"
n = 4
"""
    (work / "config.toml").write_text(toml)
    return work / "config.toml", size


def spread(*, response_ids: list[list[int]], **_: Any) -> list[float]:
    """The check's reward: a spread of values from the token ids, so every group trains."""
    return [sum(ids) % 997 / 997 for ids in response_ids]


def stages(args: argparse.Namespace, config: Path, work: Path) -> list[tuple[str, list[str], Path]]:
    """(name, command, run dir) of each step, in order; each runs under `worker` (peak memory)."""
    run, c = work / "run", str(config)

    def step(name: str, stage: str, *more: str, run_dir: Path = run, launch: tuple[str, ...] = ()) -> tuple:
        return (
            name,
            [*launch, __file__, "--worker", str(work / f"peak-{name}.json"), stage, c, *more],
            run_dir,
        )

    py = (sys.executable,)
    out = [step("generate", "generate", "--iter", "0", launch=py)]
    if args.device == "cuda" and _imports("vllm"):
        at = [f"run_dir={work / 'run-vllm'}", "generate.engine=vllm", "generate.gpu_memory_utilization=0.5"]
        sets = [x for a in at for x in ("--set", a)]
        out.append(
            step("generate_vllm", "generate", "--iter", "0", *sets, run_dir=work / "run-vllm", launch=py)
        )
    out += [step(s, s, "--iter", "0", launch=py) for s in ("score", "advantage", "train")]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    sets = ["--set", f"run_dir={work / 'run-fsdp'}", "--set", "train.fsdp=true"]
    out.append(step("train_fsdp", "train", "--iter", "0", *sets, run_dir=work / "run-fsdp", launch=torchrun))
    out.append(step("eval", "eval", "--iter", "1", launch=py))  # the policy train wrote
    return out


def _imports(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_steps(args: argparse.Namespace, config: Path, work: Path, report: dict[str, Any]) -> None:
    for name, cmd, run in stages(args, config, work):
        if name == "train_fsdp":  # the same iteration's inputs, in a run of its own
            for folder in ("rollouts", "scores", "advantages"):
                shutil.copytree(work / "run" / "iter=0000" / folder, run / "iter=0000" / folder)
        t0 = time.perf_counter()
        _run(cmd, name, {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
        m = json.loads((run / FOLDERS[name] / "_manifest.json").read_text())
        peak = json.loads((work / f"peak-{name}.json").read_text())
        report["stages"][name] = {"wall_s": time.perf_counter() - t0, **m.get("timing", {}), **peak}
        if name.startswith("train"):
            report["stages"][name].update(fsdp=m.get("fsdp"), loss=_last_loss(run))
        print(f"ok  {name:<14} {report['stages'][name].get('tokens_per_s') or 0:>10.0f} tok/s", flush=True)


def _last_loss(run: Path) -> float:
    import pyarrow.parquet as pq

    return float(
        pq.read_table(run / FOLDERS["train"] / "metrics.parquet", columns=["loss"])["loss"][-1].as_py()
    )


def utilisation(report: dict[str, Any], params: tuple[int, int], peak_tflops: float) -> None:
    """Model FLOPs per second of each stage's work and their share of the bf16 matmul peak: 2 FLOPs
    per matmul parameter per token forward (the LM head's: per response token only, where the
    stages apply it), x3 with the backward pass (train); attention's own FLOPs are left out."""
    body, head = params
    for name, s in report["stages"].items():
        if name not in PASSES or not s.get("work_s"):
            continue
        tokens, response = s.get("tokens") or 0, report["response_tokens"].get(name, 0)
        flops = 2 * PASSES[name] * (body * tokens + head * response)
        s["tflops"] = flops / s["work_s"] / 1e12
        s["bf16_utilisation"] = s["tflops"] / peak_tflops


def response_tokens(work: Path, epochs: int) -> dict[str, int]:
    """Response tokens each model stage applied the LM head to (train: over its epochs)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def count(folder: Path) -> int:
        files = sorted(folder.glob("part-*.parquet"))
        return sum(
            int(pc.sum(pc.list_value_length(pq.read_table(f, columns=["response_ids"])[0])).as_py())
            for f in files
        )

    gen = count(work / "run" / FOLDERS["generate"])
    out = {"generate": gen, "score": gen, "train": gen * epochs, "train_fsdp": gen * epochs}
    out["eval"] = count(work / "run" / FOLDERS["eval"])
    if (work / "run-vllm").exists():
        out["generate_vllm"] = count(work / "run-vllm" / FOLDERS["generate"])
    return out


def table(report: dict[str, Any]) -> str:
    """The report as markdown: one row per stage, then the numerics and the failures."""
    env = report["env"]
    lines = [
        f"GPU check {report['started']}: {env.get('device_name', report['device'])}, torch {env.get('torch')} "
        f"(accepted {env.get('accepted')}), CUDA {env.get('cuda')}, shape {report['shape']}, bf16 matmul peak "
        f"{report.get('peak_tflops', 0):.1f} TFLOP/s",
        "",
        "| stage | tokens | work s | tokens/s | TFLOP/s | bf16 utilisation | peak GPU memory | max RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["stages"].items():
        gpu = s.get("peak_gpu_bytes")
        lines.append(
            f"| {name} | {s.get('tokens', '-')} | {s.get('work_s', 0):.2f} | {s.get('tokens_per_s') or 0:.0f} | "
            f"{s.get('tflops', 0):.2f} | {100 * s.get('bf16_utilisation', 0):.1f}% | "
            f"{'-' if gpu is None else f'{gpu / 2**30:.2f} GiB'} | {s['max_rss_bytes'] / 2**30:.2f} GiB |"
        )
    if n := report.get("numerics"):
        lines += ["", "numerics vs CPU float32: " + ", ".join(f"{k} {v:.4g}" for k, v in n.items())]
    lines += ["", "result: " + ("FAILED\n" + "\n".join(report["errors"]) if report["errors"] else "ok")]
    return "\n".join(lines) + "\n"


def check(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every step; a failure stops the steps that depend on it and is recorded in `errors`."""
    import gpu_numerics

    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report: dict[str, Any] = {"started": started, "device": args.device, "shape": args.shape}
    report |= {"stages": {}, "errors": [], "env": {}}
    try:
        report["env"] = check_torch(args.device)
        config, size = prepare(args, work)
        run_steps(args, config, work, report)
        device = "cuda" if args.device == "cuda" else "cpu"
        report["peak_tflops"] = gpu_numerics.matmul_peak(device, size["peak_n"])
        report["response_tokens"] = response_tokens(work, epochs=1)
        utilisation(report, gpu_numerics.flop_params(work / "policy"), report["peak_tflops"])
        adv = work / "run" / FOLDERS["advantage"]
        report["numerics"] = gpu_numerics.compare(work / "policy", adv, device, size["slice"], 1.0)
        report["errors"] += gpu_numerics.failures(report["numerics"])
        report["errors"] += [
            f"{n}: FSDP2 did not shard" for n in ("train_fsdp",) if not report["stages"][n]["fsdp"]
        ]
    except Failure as e:
        report["errors"].append(str(e))
    except Exception as e:  # a CUDA error in this process (peak, numerics): loudly, with its type
        report["errors"].append(f"{type(e).__name__}: {e}")
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=tuple(SIZES), default="qwen2.5-0.5b")
    p.add_argument("--wheels", default="wheels", help="the folder `make wheels` wrote")
    p.add_argument("--venv", default=".venv-gpu", help="where to install it (sees the machine's torch)")
    p.add_argument("--no-install", action="store_true", help="use the rlhf_batch this Python imports")
    p.add_argument(
        "--tiny", action="store_true", help="--device cpu --shape tiny --no-install (the smoke test)"
    )
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="report and work folder")
    p.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1:])
        return 0
    args.out = args.out.resolve()  # once: the config written below names its models by absolute path
    if args.tiny:
        args.device, args.shape, args.no_install = "cpu", "tiny", True
    if not args.no_install:
        try:
            return install(args)
        except Failure as e:
            print(f"gpu_check: FAILED\n{e}", file=sys.stderr)
            return 1
    report = check(args, args.out)
    text = table(report)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_check.md").write_text(text)
    print(text, end="", file=sys.stderr if report["errors"] else sys.stdout)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
