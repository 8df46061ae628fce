"""Shared pieces of the benchmarks: machine facts, matmul peaks, the workload, workers, results.

Every measurement runs in a fresh worker subprocess (`python bench_X.py --worker NAME --spec
JSON`), so peak memory does not bleed from one measurement into the next. A worker reports
its figures as one JSON line on stdout; `Mem` gives the peak RSS above a mark (the loaded
model): it resets the kernel's high-water mark (/proc/self/clear_refs) at the mark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results.md"
CACHE = Path(os.environ.get("RLHF_BATCH_BENCH_CACHE", "/tmp/rlhf-batch-bench"))
HEADER = (
    "| date | machine | benchmark | workload | metric | ours | baseline | ratio | peak mem above model "
    "(ours / baseline) | target | met |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
)

# The workload of the issue: a Qwen2-shaped ~40M-parameter model (tied embeddings), 512 rollouts.
FULL_MODEL = {
    "hidden": 512,
    "layers": 8,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 1408,
    "vocab_size": 32000,
}
TINY_MODEL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 0}
GROUP = 8  # rollouts per prompt
NOTE = (
    "Where the machine column says 'no bf16 units' (AVX2 only), bf16 matmuls run several times slower than "
    "float32, the stages run in float32, and MFU against the bf16 peak is not meaningful (read the figure "
    "against the float32 peak). Figures are comparable within one run only (a shared machine drifts). "
    "A machine column ending in 'busy: load L > T' means the 1-minute load average exceeded T while that "
    "benchmark measured (T = its own threads + half the cores), 'tiny' a --tiny run: such rows do not reach "
    "the table of docs/performance.md (benchmarks/table.py).\n\n"
)


# ---------------------------------------------------------------- machine and peaks


def machine() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "?"
    bf16 = "bf16 units" if any(f in flags for f in ("amx_bf16", "avx512_bf16")) else "no bf16 units"
    return f"{model}, {os.cpu_count()} cores, {isa}, {bf16}"


def auto_dtype() -> str:
    """What `dtype = "auto"` resolves to on this CPU (the stages' default): bfloat16 where the CPU has
    bf16 matrix units (AVX512-BF16, AMX), else float32."""
    from rlhf_batch.runtime.device import cpu_has_bf16

    return "bfloat16" if cpu_has_bf16() else "float32"


def cpu_kind_line() -> str:
    """One line saying which kind of CPU a run adapts to, printed at the start of `make bench`."""
    dtype = auto_dtype()
    peak = "bf16" if dtype == "bfloat16" else "fp32"
    return (
        f"# CPU: {machine()}: dtype auto = {dtype}, so the stages run in {dtype} and the MFU targets "
        f"are read against the {peak} matmul peak"
    )


def mfu_target(dtype: str, target: float, bf16_units: bool) -> tuple[str, bool]:
    """(target text, whether it is read on executed FLOPs) for a stage that ran in `dtype`.
    In bfloat16 (dtype auto on a CPU with bf16 units) the target is a share of the bf16 peak on the
    FLOPs actually executed; in float32 (dtype auto on AVX2 only) a share of the fp32 peak by the
    formula's FLOPs."""
    if "bfloat16" in dtype:
        return f">= {target:.0%} of the bf16 peak on executed FLOPs", True
    units = "" if bf16_units else " (bf16 peak not meaningful here: no bf16 units)"
    return f">= {target:.0%} of the fp32 peak{units}", False


def append_mfu_row(
    path: Path,
    bench: str,
    workload: str,
    factor: int,
    ours: dict[str, Any],
    naive: dict[str, Any],
    flop_params: tuple[int, int],
    peaks: dict[str, float],
    dtype: str,
    target: float,
    ceiling: float | None = None,
) -> None:
    """The MFU row: `factor` x matmul params x real tokens / s over the matmul peak, against the
    float32 and the bf16 peak; in brackets the utilisation of the FLOPs actually executed (the
    decoder at `executed_tokens`, the LM head at `response_tokens`). Whether the target is met is
    read as `mfu_target` says for `dtype`, the dtype the stage ran in. `ceiling`: GFLOP/s of the
    model's own matmul shapes in that dtype (shape_ceiling), given as the share of it reached."""
    body, head = flop_params

    def issue(r: dict[str, Any], peak: float) -> float:
        return factor * (body + head) * r["tokens"] / r["seconds"] / (peak * 1e9)

    def executed(r: dict[str, Any], peak: float) -> float:
        flops = factor * (body * r["executed_tokens"] + head * r["response_tokens"])
        return flops / r["seconds"] / (peak * 1e9)

    fp32, bf16 = peaks["fp32_gflops"], peaks["bf16_gflops"]
    text, on_executed = mfu_target(dtype, target, not machine().endswith("no bf16 units"))
    reached = executed(ours, bf16) if on_executed else issue(ours, fp32)
    if ceiling:
        peak = bf16 if "bfloat16" in dtype else fp32
        workload += (
            f"; the model's matmul shapes run at {ceiling:.0f} GFLOP/s here in {dtype} "
            f"({ceiling / peak:.0%} of its peak): executed FLOPs at {executed(ours, ceiling):.0%} of that"
        )
    append_row(
        path,
        bench,
        workload,
        f"MFU = {factor} x params x real tokens / s / peak: vs fp32 peak / vs bf16 peak "
        "[executed FLOPs: fp32 / bf16]",
        f"{issue(ours, fp32):.0%} / {issue(ours, bf16):.0%} [{executed(ours, fp32):.0%} / {executed(ours, bf16):.0%}]",
        f"{issue(naive, fp32):.0%} / {issue(naive, bf16):.0%}",
        target=text,
        met=reached >= target,
    )


def _gflops(fn: Any, flops: float, seconds: float = 1.0) -> float:
    fn()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = max(best, flops / (time.perf_counter() - t0))
    return best / 1e9


def measure_bandwidth(elems: int = 1 << 25, seconds: float = 1.0) -> dict[str, float]:
    """STREAM-like memory bandwidth (GB/s, best of repeated runs, all torch threads) over float32
    arrays of `elems` elements (128 MB each by default, far beyond the caches): copy `b = a`
    moves 2 x 4 bytes per element, triad `a = b + 3 c` moves 3 x 4."""
    import torch

    a, b, c = torch.rand(elems), torch.rand(elems), torch.rand(elems)
    gb = elems * 4 / 1e9
    copy = _gflops(lambda: b.copy_(a), 2 * gb * 1e9, seconds)
    triad = _gflops(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * gb * 1e9, seconds)
    return {"mem_copy_gbs": copy, "mem_triad_gbs": triad}


def shape_ceiling(model: Any, dtype: Any, rows: int = 2048, head_rows: int = 65) -> float:
    """GFLOP/s of F.linear at the model's own matmul shapes in `dtype` (each decoder Linear with
    `rows` tokens, the LM head with `head_rows`, a chunk of the log-prob path), FLOP-weighted:
    the best the executed FLOPs can run at here. A model with hidden 512 multiplies by K = 512,
    which runs below the 2048 x 2048 peak."""
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    flops = seconds = 0.0
    with torch.no_grad():
        for w, n in [*[(w, rows) for w in mats], (head.weight, head_rows)]:
            w = w.detach().to(dtype)
            x = torch.randn(n, w.shape[1], dtype=dtype)
            f = 2.0 * n * w.shape[0] * w.shape[1]
            flops += f
            seconds += f / (_gflops(lambda x=x, w=w: F.linear(x, w), f, 0.2) * 1e9)
    return flops / seconds / 1e9


def measure_peaks(n: int = 2048, stream_elems: int = 1 << 25) -> dict[str, float]:
    """Best GFLOP/s of an n x n matmul through F.linear (the path nn.Linear and autocast take),
    bf16 and float32. torch.mm in bf16 takes a far slower fallback on AVX2-only CPUs; it is
    reported too, for the record. Also the memory bandwidth (`measure_bandwidth`)."""
    import torch
    import torch.nn.functional as F

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"{name}_gflops"] = _gflops(lambda a=a, b=b: F.linear(a, b), 2 * n**3)
    a, b = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
    out["bf16_mm_gflops"] = _gflops(lambda: a @ b, 2 * 256**3, 0.3)
    out["threads"] = torch.get_num_threads()
    return {**out, **measure_bandwidth(stream_elems)}


# ---------------------------------------------------------------- load of the machine

# A figure counts only if it was measured on a quiet machine. The 1-minute load average counts the
# runnable threads; a benchmark's own threads are one per core (torch's and DuckDB's pools), so on
# a quiet machine it reads about `cores` during a measurement (and still shortly after one). Other
# work beyond half the cores (one busy process on 2 cores) takes a third of the CPU from a
# benchmark using all of them (2 / (2 + 1)): figures drift by up to 1.5x, more than the ratios
# measured. Below that the noise of a quiet machine (the benchmark's parent process, its process
# starts, the system's daemons) would mark quiet runs. The average lags by about a minute, so it
# catches sustained load (the busy runs of the past read 3-14 on 2 cores), not short bursts.
BUSY_SHARE = 0.5


def loadavg() -> float | None:
    """The 1-minute load average (/proc/loadavg); None where there is none."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def busy_mark(loads: Iterable[float | None], cores: int, own_threads: int, share: float = BUSY_SHARE) -> str:
    """'busy: load L > T' when the highest of the 1-minute load averages read around the
    measurements exceeds T = the benchmark's own threads + `share` x cores; '' when quiet or unknown."""
    seen = [x for x in loads if x is not None]
    limit = own_threads + share * cores
    if not seen or max(seen) <= limit:
        return ""
    return f"busy: load {max(seen):.1f} > {limit:.1f}"


def start_refusal(load: float | None, cores: int) -> str:
    """Why `make bench` does not start at this 1-minute load average ('' when it may): nothing of
    the benchmarks runs yet, so anything above `BUSY_SHARE` x cores is other work."""
    busy = busy_mark([load], cores, own_threads=0)
    if not busy:
        return ""
    return (
        f"the machine is busy before any benchmark ran ({busy}, {cores} cores): figures would not "
        "count; wait for a quiet machine, or pass --allow-busy (rows then marked busy)"
    )


CORES = os.cpu_count() or 1
# Load averages read in this process: at the start, before and after every worker, at every row.
# A row is marked busy when any of them, up to that row, was high (the benchmark's earlier
# measurements feed its later rows).
LOADS: list[float | None] = [loadavg()]
TINY_RUN = False  # set by --tiny: the rows of a tiny run are marked "tiny"


def row_marks() -> str:
    """The marks appended to the machine column of the next row: '; tiny', '; busy: load L > T'."""
    LOADS.append(loadavg())
    marks = ["tiny"] if TINY_RUN else []
    busy = busy_mark(LOADS, CORES, own_threads=CORES)
    return "".join(f"; {m}" for m in [*marks, busy] if m)


# ---------------------------------------------------------------- workload


@dataclass
class Workload:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True))

    @property
    def response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def head(self, n: int) -> Workload:
        return Workload(self.prompt_ids[:n], self.response_ids[:n])


def response_lengths(n: int, rng: np.random.Generator, cap: int = 512) -> np.ndarray:
    """Skewed: 70% uniform in cap/64..cap/8, 20% in cap/8+1..cap/2, 10% in cap/2+1..cap
    (cap 512: 8..64, 65..256, 257..512; mean ~96, median ~45)."""
    kind = rng.choice(3, size=n, p=[0.7, 0.2, 0.1])
    lo = np.array([max(1, cap // 64), cap // 8 + 1, cap // 2 + 1])[kind]
    hi = np.array([cap // 8, cap // 2, cap])[kind]
    return rng.integers(lo, hi + 1)


def make_workload(n: int, vocab: int, *, tiny: bool = False, seed: int = 0, cap: int = 512) -> Workload:
    """n rollouts, GROUP per prompt; prompts uniform in 32..256 tokens (4..16 when tiny),
    responses skewed (see response_lengths; `cap` 512, 24 when tiny). Token ids uniform in
    [5, vocab) (ids 0..4 are the tokenizer's specials)."""
    rng = np.random.default_rng(seed)
    n_prompts = -(-n // GROUP)
    p_lens = rng.integers(4, 17, n_prompts) if tiny else rng.integers(32, 257, n_prompts)
    prompts = [rng.integers(5, vocab, int(k)).tolist() for k in p_lens]
    r_lens = response_lengths(n, rng, cap=24 if tiny else cap)
    return Workload(
        [prompts[i // GROUP] for i in range(n)], [rng.integers(5, vocab, int(k)).tolist() for k in r_lens]
    )


def lengths_text(w: Workload) -> str:
    p = np.array([len(x) for x in w.prompt_ids])
    r = np.array([len(x) for x in w.response_ids])
    return (
        f"{len(w)} rollouts, prompts {p.min()}..{p.max()} (mean {p.mean():.0f}), "
        f"responses {r.min()}..{r.max()} (mean {r.mean():.0f}, median {np.median(r):.0f})"
    )


def model_dir(
    tiny: bool, vocab_size: int | None = None, untied: bool = False, spec: dict[str, int] | None = None
) -> Path:
    """The benchmark model, built once into CACHE (random weights, saved in HF format); `spec`
    overrides parts of its shape (attention heads)."""
    from rlhf_batch.models.tiny import init_model

    shape = spec
    spec = {**(TINY_MODEL if tiny else FULL_MODEL), **(shape or {})}
    if vocab_size is not None:
        spec["vocab_size"] = vocab_size
    name = f"qwen2-h{spec['hidden']}-l{spec['layers']}-v{spec['vocab_size']}"
    if shape:
        name += f"-a{spec['heads']}-kv{spec['kv_heads']}"
    path = CACHE / "models" / name
    if not (path / "config.json").exists():
        init_model(path, arch="qwen2", seed=0, **spec)
    return path


def flop_params(model: Any) -> tuple[int, int]:
    """(decoder matmul parameters, LM-head parameters): embeddings and norms do no matmul."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and "embed" not in n and "lm_head" not in n
    )
    return body, head


# ---------------------------------------------------------------- workers and memory


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


class Mem:
    """Peak RSS (bytes) above the RSS at `mark()`."""

    def __init__(self) -> None:
        self.base = _status("VmRSS")

    def mark(self) -> None:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        self.base = _status("VmRSS")

    def peak_above(self) -> int:
        return max(0, _status("VmHWM") - self.base)


def run_worker(script: str, name: str, spec: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """Run `script --worker name --spec JSON` in a fresh process; its last stdout line is JSON.
    With spec["tiny"] (the smoke test) the worker runs in this process instead: the figures of
    a tiny run mean nothing, and a process start costs seconds."""
    LOADS.append(loadavg())
    try:
        if spec.get("tiny"):
            import importlib

            return importlib.import_module(script.removesuffix(".py")).WORKERS[name](spec)
        cmd = [sys.executable, str(HERE / script), "--worker", name, "--spec", json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    finally:
        LOADS.append(loadavg())
    if proc.returncode != 0:
        raise RuntimeError(f"{script} worker {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


class _Tiny(argparse.Action):
    """store_true that also marks this process's rows "tiny" (they are never a run's figures)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        global TINY_RUN
        TINY_RUN = True
        setattr(namespace, self.dest, True)


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--tiny", action=_Tiny, help="tiny model and workload (the smoke test)")
    p.add_argument("--peaks", type=Path, help="JSON of peak.py; measured here when not given")
    p.add_argument("--results", type=Path, default=RESULTS, help="markdown table to append rows to")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def peaks_from(args: argparse.Namespace) -> dict[str, float]:
    """The peaks run_all measured (--peaks), else measured here; then this benchmark's rows are a
    run of their own in the results, which starts with its "matmul peak" row."""
    if args.peaks and args.peaks.exists():
        return json.loads(args.peaks.read_text())
    peaks = run_worker("peak.py", "peak", {"tiny": args.tiny})
    append_peak_row(args.results, peaks)
    return peaks


def append_peak_row(path: Path, peaks: dict[str, float]) -> None:
    """The row that starts a run in the results (benchmarks/table.py groups rows into runs by it)."""
    append_row(
        path,
        "matmul peak",
        f"2048 x 2048 F.linear, all threads; dtype auto here: {auto_dtype()}",
        "GFLOP/s fp32 / bf16 (bf16 torch.mm)",
        f"{peaks['fp32_gflops']:.0f} / {peaks['bf16_gflops']:.1f} ({peaks['bf16_mm_gflops']:.1f})",
    )


# ---------------------------------------------------------------- results


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MB"


def append_row(
    path: Path,
    bench: str,
    workload: str,
    metric: str,
    ours: str,
    baseline: str = "-",
    ratio: str = "-",
    mem: str = "-",
    target: str = "-",
    met: bool | None = None,
) -> None:
    """Print one result row and append it to the markdown table at `path`."""
    cells = [
        time.strftime("%Y-%m-%d %H:%M"),
        machine() + row_marks(),
        bench,
        workload,
        metric,
        ours,
        baseline,
        ratio,
        mem,
        target,
        "-" if met is None else ("yes" if met else "**no**"),
    ]
    row = "| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n"
    print(row, end="", flush=True)
    new = not path.exists() or not path.read_text().strip()
    with open(path, "a") as f:
        if new:
            f.write(
                "# Benchmark results\n\nAppended by `make bench` (benchmarks/run_all.py); see docs/performance.md.\n\n"
            )
            f.write(NOTE)
            f.write(HEADER)
        f.write(row)


def fit_exponent(sizes: list[float], times: list[float]) -> float:
    """b of time = a * size^b, least squares in log-log."""
    return float(np.polyfit(np.log(sizes), np.log(times), 1)[0])
