"""Live experiment tracking: TensorBoard, trackio, Weights & Biases and MLflow (`report_to`).

Every stage sends its headline numbers when it finishes (`log_stage`, called where the manifest
is written), and train sends each optimizer step's metrics as it happens (`open_run` ...
`Run.log_step` ... `Run.close`). All trackers of a run share one run name (`run_name`, default
the run_dir's folder name) and project (`tracking_project`, default "rlhf-batch"), and get the
resolved config attached. Each stage is a separate process, so each one re-opens the same run:
wandb by a fixed id derived from the run dir (resume="allow"), trackio and MLflow by run name,
TensorBoard by its log directory.

Two step axes, kept apart in every tracker:
* `<stage>/<name>` (e.g. `scores/reward_mean`, `train/loss_mean`) at step = iteration;
* `train_step/<name>` (the columns of train's metrics.parquet) at the global optimizer step:
  the row's `step` plus the steps of every earlier iteration's train manifest, so the curve
  continues across iterations. wandb gets them as two `define_metric` step metrics
  (`iteration`, `global_step`), the others take the step directly.

A tracker whose package is missing is a ConfigError when the config is loaded (one line naming
the extra, before any work). A tracker that fails to open or to log is disabled with one
warning line on stderr: tracking never fails or changes a stage. Only rank 0 logs.
Where they write: TensorBoard RUN_DIR/tracking/tensorboard; wandb RUN_DIR/tracking/wandb
(WANDB_MODE=offline works as usual); MLflow MLFLOW_TRACKING_URI, else a file store in
RUN_DIR/tracking/mlruns; trackio its own store (TRACKIO_DIR, or a Space with TRACKIO_SPACE_ID).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from rlhf_batch.store.fs import local_side
from rlhf_batch.store.layout import METRICS_FILE, TRACKING_DIR

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
_TOP_NUMBERS = ("rows", "kl_coef", "mean_kl_sum", "batch_std")  # manifest keys worth a curve


def settings(cfg: Any) -> dict[str, Any]:
    """The tracking keys of a Config or of its resolved dict."""
    d = cfg if isinstance(cfg, dict) else {} if cfg is None else cfg.to_dict()
    run_dir = str(d.get("run_dir", ""))
    return {
        "report_to": list(d.get("report_to") or []),
        "run_dir": run_dir,
        "run_name": d.get("run_name") or run_dir.rstrip("/").rsplit("/", 1)[-1] or "rlhf-batch",
        "project": d.get("tracking_project") or "rlhf-batch",
        "config": d,
    }


def warn(msg: str) -> None:
    print(f"warning: tracking: {msg}", file=sys.stderr)


class Run:
    """The open trackers of one process. Never raises: a failing tracker is dropped with a warning."""

    def __init__(self, cfg: Any, step_offset: int = 0):
        self.step_offset = step_offset
        self.trackers: list[Any] = []
        s = settings(cfg)
        from rlhf_batch.runtime import dist

        if not dist.leads():
            return
        for name in s["report_to"]:
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    self.trackers.append(_OPEN[name](s))
            except Exception as e:
                warn(f"{name} could not be opened ({type(e).__name__}: {e}); it is off for this stage")

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        """Send `metrics` at `step` of `axis` ("iteration" or "global_step")."""
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        for t in list(self.trackers):
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    t.log(clean, step, axis)
            except Exception as e:
                self.trackers.remove(t)
                warn(f"{t.name} failed ({type(e).__name__}: {e}); it is off for the rest of this stage")
                with contextlib.suppress(Exception), contextlib.redirect_stdout(sys.stderr):
                    t.close()

    def log_step(self, row: dict[str, Any]) -> None:
        """One optimizer step of train (a metrics.parquet row) at the global step."""
        if self.trackers:
            step = self.step_offset + int(row["step"])
            values = {f"train_step/{k}": v for k, v in row.items() if k != "step" and v is not None}
            self.log(values, step, "global_step")  # None: a token mean of a step that ran no row

    def close(self) -> None:
        for t in self.trackers:
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    t.close()
            except Exception as e:
                warn(f"{t.name} failed to close ({type(e).__name__}: {e})")
        self.trackers = []


def open_run(cfg: Any, iteration: int) -> Run:
    """Trackers for train's per-step metrics, the global step continuing from earlier iterations."""
    s = settings(cfg)
    if not s["report_to"]:
        return Run({})
    return Run(cfg, step_offset=steps_before(s["run_dir"], iteration))


def steps_before(run_dir: str, iteration: int) -> int:
    """Optimizer steps of the train stages of iterations before `iteration` (from their manifests)."""
    from rlhf_batch.store import layout
    from rlhf_batch.store.manifests import manifest

    total = 0
    for it in range(iteration):
        m = manifest(layout.folder(run_dir, it, layout.TRAIN)) or {}
        total += int((m.get("counts") or {}).get("steps", 0))
    return total


def log_stage(cfg: Any, sdir: Path, manifest: dict[str, Any] | None) -> None:
    """Send a finished stage's headline numbers at step = its iteration. Never raises."""
    if manifest is None or not settings(cfg)["report_to"]:
        return
    try:
        iteration, prefix = _where(sdir, manifest["stage"])
        numbers = headline(sdir, manifest)
    except Exception as e:
        warn(f"headline numbers of {sdir} could not be read ({type(e).__name__}: {e})")
        return
    run = Run(cfg)
    run.log({f"{prefix}/{k}": v for k, v in numbers.items()}, iteration, "iteration")
    run.close()


def _where(sdir: Path, stage: str) -> tuple[int, str]:
    """(iteration, key prefix) of a stage folder: iter=K/<stage>, or iter=K/topup=RR/<stage> (a
    top-up round, logged under `<stage>_topupRR/` so it does not overwrite round 0's numbers)."""
    parent = sdir.parent
    if parent.name.startswith("topup="):
        return int(parent.parent.name.split("=")[1]), f"{stage}_topup{int(parent.name.split('=')[1]):02d}"
    return int(parent.name.split("=")[1]), stage


def headline(sdir: Path, manifest: dict[str, Any]) -> dict[str, float]:
    """A stage's numbers: the manifest's counts and a few of its values, plus means read from
    the parts (rollouts: response length; scores: score, reward, kl_sum; train: loss)."""
    import pyarrow.compute as pc

    from rlhf_batch.store import manifests  # pyarrow: not needed to log (trackio's venv has none)

    out: dict[str, float] = {}
    for group in ("prompt_counts", "counts"):
        out.update({k: v for k, v in (manifest.get(group) or {}).items() if _is_number(v)})
    out.update({k: manifest[k] for k in _TOP_NUMBERS if _is_number(manifest.get(k))})
    files = [sdir / p["file"] for p in manifest.get("parts", [])]
    stage = manifest.get("stage")
    if stage == "rollouts" and files:
        lengths = [
            pc.list_value_length(manifests.read_table(f, columns=["response_ids"])["response_ids"])
            for f in files
        ]
        total = sum(int(pc.sum(x).as_py() or 0) for x in lengths)
        out["response_tokens"] = total
        out["response_length_mean"] = total / max(1, sum(len(x) for x in lengths))
    elif stage == "scores" and files:
        t = _concat([manifests.read_table(f, columns=["score", "reward", "kl_sum"]) for f in files])
        out.update({f"{c}_mean": pc.mean(t[c]).as_py() for c in ("score", "reward", "kl_sum")})
    elif stage == "eval":  # per data source and overall: eval/<source>/pass_at_1 (MLflow has no '@')
        from rlhf_batch.core.eval_metrics import with_overall

        for source, values in with_overall(manifest).items():
            name = re.sub(r"[^\w./ -]", "_", source)
            out.update({f"{name}/{k.replace('@', '_at_')}": v for k, v in values.items()})
    elif stage == "train" and (sdir / METRICS_FILE).exists():
        loss = manifests.read_table(sdir / METRICS_FILE, columns=["loss"])["loss"]
        if len(loss):
            out["loss_mean"] = pc.mean(loss).as_py()
            out["loss_last"] = loss[-1].as_py()
    return {k: float(v) for k, v in out.items() if _is_number(v)}


def _concat(tables: list[Any]) -> Any:
    import pyarrow as pa

    return pa.concat_tables(tables, promote_options="permissive")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"train.lr": "1e-05", ...} (for trackers that take flat string params)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, s: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        logdir = local_side(s["run_dir"], TRACKING_DIR) / "tensorboard"
        first = not any(logdir.glob("events.out.tfevents.*"))
        self.w = SummaryWriter(str(logdir))
        if first:
            self.w.add_text("config", "```json\n" + json.dumps(s["config"], indent=1) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    name = "wandb"

    def __init__(self, s: dict[str, Any]):
        import wandb

        tdir = local_side(s["run_dir"], TRACKING_DIR)
        tdir.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha256(str(tdir.parent.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=s["project"],
            name=s["run_name"],
            id=run_id,
            resume="allow",
            dir=str(tdir),
            config=s["config"],
            reinit="create_new",
        )
        for axis in ("iteration", "global_step"):
            self.run.define_metric(axis)
        self.defined: set[str] = set()

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        for prefix in {k.split("/")[0] for k in metrics} - self.defined:
            self.run.define_metric(f"{prefix}/*", step_metric=axis)
            self.defined.add(prefix)
        self.run.log({**metrics, axis: step})

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    name = "trackio"

    def __init__(self, s: dict[str, Any]):
        import trackio

        self.run = trackio.init(
            project=s["project"],
            name=s["run_name"],
            config=_flat(s["config"]),
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    name = "mlflow"

    def __init__(self, s: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # our own local file store (mlflow-skinny has no database backend)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (local_side(s["run_dir"], TRACKING_DIR) / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(s["project"])
        exp_id = exp.experiment_id if exp else self.client.create_experiment(s["project"])
        name = s["run_name"].replace("'", "")
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.mlflow.runName = '{name}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            self._params(_flat(s["config"]))

    def _params(self, flat: dict[str, str]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_OPEN = {"tensorboard": _TensorBoard, "trackio": _Trackio, "wandb": _Wandb, "mlflow": _Mlflow}
