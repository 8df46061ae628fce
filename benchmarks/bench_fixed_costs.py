"""Fixed costs of an iteration: model and optimizer-state loads and saves, before and after.

Side by side in one run, each measurement in a fresh worker process:

- "stage-process model load": `load_model` of the benchmark model in a process that loads it
  once (a stage process). Before: a template was made on every load (the files read a second
  time and compared, models/load.py); after: none is made outside a process that keeps models.
- "in-process reload": the next load of a model a `run` with `in_process` already loaded (the
  template exists). Before: the weights are read from the files; after: copied from memory
  (models/resident.py). The same for the carried AdamW state (`optim_state.load`).
- "optimizer state save": bytes and time of the carried AdamW state, float32 against bfloat16
  moments (`train.optimizer_state_dtype`), and the device-to-host copies one save makes on a
  GPU (counted on fake CUDA tensors: one per tensor before, one per dtype after).
- "demo in-process": pipelines/demo.toml for 3 iterations, as `run` does it now (models and
  state kept) and with nothing kept (what it did before): model and optimizer loads from disk
  per iteration, the seconds spent loading in iterations >= 1, bytes written per iteration,
  and whether both runs wrote the same rows and weights (bit for bit).

Times are best of 3 (loads) on a shared machine: read the counts and bytes first.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import append_row, emit, model_dir, run_worker  # noqa: E402


def _best(fn: Any, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _adamw_state(model: Any) -> dict[str, Any]:
    """A fused-AdamW-shaped state over `model`'s parameters (moments random, step 4)."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {
        i: {
            "step": torch.tensor(4.0),
            "exp_avg": torch.randn(p.shape, generator=g),
            "exp_avg_sq": torch.rand(p.shape, generator=g),
        }
        for i, p in enumerate(model.parameters())
    }
    return {"state": state, "param_groups": [{"lr": 1e-3, "params": list(state)}]}


def work_loads(spec: dict[str, Any]) -> dict[str, Any]:
    from rlhf_batch.models import load, optim_state, resident

    path = str(model_dir(spec["tiny"]))
    out: dict[str, Any] = {"bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))}

    def stage_load(templates: bool) -> None:
        load._TEMPLATES.clear()
        with resident.keep() if templates else contextlib.nullcontext():
            load.load_model(path, "policy", dtype="float32")

    out["stage_before"], out["stage_after"] = (
        _best(lambda: stage_load(True)),
        _best(lambda: stage_load(False)),
    )
    with resident.keep():
        model = load.load_model(path, "policy", dtype="float32")  # the template, the weights kept

        def reread() -> None:
            resident.clear()
            load.load_model(path, "policy", dtype="float32")

        out["reload_before"] = _best(reread)
        load.load_model(path, "policy", dtype="float32")
        out["reload_after"] = _best(lambda: load.load_model(path, "policy", dtype="float32"))
        names, state = optim_state.param_names(model), _adamw_state(model)
        with tempfile.TemporaryDirectory() as tmp:
            for dtype in ("float32", "bfloat16"):
                d = Path(tmp) / dtype
                d.mkdir()
                moments = None if dtype == "float32" else getattr(__import__("torch"), dtype)
                out[f"save_{dtype}"] = _best(lambda d=d, m=moments: optim_state.save(d, state, names, {}, m))
                out[f"bytes_{dtype}"] = (d / optim_state.TENSORS).stat().st_size
            d = Path(tmp) / "float32"
            resident.clear()
            out["state_before"] = _best(lambda: optim_state.load(d, names, by_name=False))

            def kept() -> None:  # each load takes the kept state over: kept again before each
                optim_state.keep_written(d, optim_state.save(d, state, names, {}))
                t0 = time.perf_counter()
                optim_state.load(d, names, by_name=False)
                times.append(time.perf_counter() - t0)

            times: list[float] = []
            _best(kept)
            out["state_after"] = min(times)
    out.update(_host_copies(model))
    return out


def _host_copies(model: Any) -> dict[str, int]:
    """Device-to-host copies of one optimizer-state save on a GPU, counted on fake CUDA tensors:
    one `.cpu()` per tensor (before) against `optim_state.to_host` (after), float32 moments."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf_batch.models import optim_state

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            ins = [a for a in args if isinstance(a, torch.Tensor)]
            if isinstance(out, torch.Tensor) and out.device.type == "cpu" and any(a.is_cuda for a in ins):
                self.n += 1
            return out

    with FakeTensorMode():
        tensors = {
            f"{n}/{k}": torch.empty(p.shape if k != "step" else (), device="cuda")
            for n, p in model.named_parameters()
            for k in ("exp_avg", "exp_avg_sq", "step")
        }
        with Count() as before:
            [t.cpu() for t in tensors.values()]
        with Count() as after:
            optim_state.to_host(tensors)
    return {"copies_before": before.n, "copies_after": after.n}


def work_demo(spec: dict[str, Any]) -> dict[str, Any]:
    """pipelines/demo.toml in this process for spec["iterations"], models kept or not."""
    from rlhf_batch.commands import pipeline
    from rlhf_batch.models import load, optim_state, resident

    spent = {"s": 0.0}

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t0

        return wrapper

    reads: list[dict[str, Any]] = []
    real_iteration = pipeline.run_iteration

    def iteration(cfg: Any, it: int, *a: Any, **k: Any) -> None:
        before, spent["s"] = dict(resident.DISK_READS), 0.0
        real_iteration(cfg, it, *a, **k)
        counts = {kind: resident.DISK_READS[kind] - before.get(kind, 0) for kind in ("model", "optimizer")}
        reads.append({**counts, "load_s": spent["s"]})

    patches = [
        (pipeline, "run_iteration", iteration),
        (load, "load_model", timed(load.load_model)),
        (optim_state, "load", timed(optim_state.load)),
    ]
    if not spec["kept"]:
        patches.append((pipeline, "_resident", lambda _: contextlib.nullcontext()))
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    run = Path(spec["run_dir"])
    try:
        for m, name, fn in patches:
            setattr(m, name, fn)
        sets = [f"run_dir={run}", f"iterations={spec['iterations']}"]
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            pipeline.run_pipeline(common.ROOT / "pipelines" / "demo.toml", sets, quiet=True)
        wall = time.perf_counter() - t0
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
    written = [
        sum(
            f.stat().st_size
            for f in (run / f"iter={it:04d}").rglob("*")
            if f.is_file() and "policy" in f.parts
        )
        + sum(f.stat().st_size for f in (run / f"iter={it:04d}" / "train" / "optimizer").glob("*"))
        for it in range(spec["iterations"])
    ]
    return {"reads": reads[: spec["iterations"]], "wall": wall, "written": written, "digest": _digest(run)}


def _digest(run: Path) -> str:
    """sha256 over every Parquet table's rows (without the wall-clock rate) and every tensor."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for f in sorted(run.rglob("*.parquet")):
        t = pq.read_table(f)
        h.update(
            repr(t.drop_columns([c for c in t.column_names if c == "tokens_per_s"]).to_pylist()).encode()
        )
    for f in sorted(run.rglob("*.safetensors")):
        if f.name != "rng.safetensors":
            for k, v in sorted(load_file(str(f)).items()):
                h.update(k.encode() + v.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


WORKERS = {"loads": work_loads, "demo": work_demo}


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    if args.worker:
        emit(WORKERS[args.worker](__import__("json").loads(args.spec)))
        return
    r = run_worker("bench_fixed_costs.py", "loads", {"tiny": args.tiny})
    shape = "tiny model" if args.tiny else "40M-parameter model"
    what = f"{shape}, float32, {r['bytes'] / 1e6:.0f} MB of weights"
    ratio = lambda a, b: f"{a / b:.1f}x" if b else "-"  # noqa: E731
    res = args.results
    append_row(res, "stage-process model load", what, "load_model wall (after / before: template made)",
               f"{r['stage_after']:.3f}s", f"{r['stage_before']:.3f}s", ratio(r["stage_before"], r["stage_after"]))  # fmt: skip
    append_row(res, "in-process reload", what, "load_model wall (after: kept in memory / before: files read)",
               f"{r['reload_after']:.3f}s", f"{r['reload_before']:.3f}s", ratio(r["reload_before"], r["reload_after"]))  # fmt: skip
    append_row(res, "in-process optimizer reload", what + "; AdamW state float32",
               "optim_state.load wall (after: kept / before: file read)",
               f"{r['state_after']:.3f}s", f"{r['state_before']:.3f}s", ratio(r["state_before"], r["state_after"]))  # fmt: skip
    append_row(res, "optimizer state save", what,
               "bytes, save wall (bfloat16 moments / float32); device-to-host copies per save on a GPU (after / before)",
               f"{r['bytes_bfloat16'] / 1e6:.1f} MB, {r['save_bfloat16']:.3f}s; {r['copies_after']} copy",
               f"{r['bytes_float32'] / 1e6:.1f} MB, {r['save_float32']:.3f}s; {r['copies_before']} copies",
               f"{r['bytes_bfloat16'] / r['bytes_float32']:.2f}", target="1 copy per dtype",
               met=r["copies_after"] == 1)  # fmt: skip
    iterations = 2 if args.tiny else 3
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            mode: run_worker(
                "bench_fixed_costs.py",
                "demo",
                {
                    "tiny": args.tiny,
                    "kept": mode == "kept",
                    "iterations": iterations,
                    "run_dir": f"{tmp}/{mode}",
                },
            )
            for mode in ("kept", "read")
        }
    kept, read = runs["kept"], runs["read"]

    def later(run: dict[str, Any]) -> str:
        rest = run["reads"][1:]
        loads = sum(x["model"] for x in rest), sum(x["optimizer"] for x in rest)
        return f"{loads[0]} model + {loads[1]} optimizer loads from disk, {sum(x['load_s'] for x in rest):.3f}s loading"

    same = kept["digest"] == read["digest"]
    append_row(res, "demo in-process", f"pipelines/demo.toml, {iterations} iterations; rows and weights identical: {'yes' if same else 'NO'}",
               "iterations >= 1: loads from disk and seconds in load_model + optim_state.load (kept / nothing kept)",
               later(kept), later(read), target="0 loads from disk, identical", met=same and later(kept).startswith("0 model + 0"))  # fmt: skip
    per_it = lambda run: f"{sum(run['written']) / len(run['written']) / 1e3:.0f} kB"  # noqa: E731
    append_row(res, "demo bytes written per iteration", "policy + AdamW state (float32), as above",
               "bytes (kept / nothing kept)", per_it(kept), per_it(read))  # fmt: skip


if __name__ == "__main__":
    main()
