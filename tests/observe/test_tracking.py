"""Live tracking (report_to), offline: a real two-iteration run logs to TensorBoard, wandb
(WANDB_MODE=offline) and MLflow (local file store); each test reads back what its tracker stored
and compares it with the run's own files. trackio runs in .venv-trackio (make trackio)."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import tomli_w

from rlhf_batch.config import load_config, missing_trackers
from rlhf_batch.errors import ConfigError
from rlhf_batch.observe import tracking
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests

ROOT = Path(__file__).resolve().parents[2]
TRACKIO_PY = ROOT / ".venv-trackio" / "bin" / "python"


def write_config(path: Path, tiny_model: Path, prompts: Path, **top: object) -> Path:
    raw = {
        "run_dir": str(path.parent / "run"),
        "policy_model": str(tiny_model),
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "generate": {
            "prompts": str(prompts),
            "num_generations": 4,
            "max_new_tokens": 6,
            "prompts_per_part": 5,
        },
        "score": {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True},
        "train": {"lr": 1e-3, "tokens_per_step": 256},
        **top,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(raw))
    return path


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_prompts: Path):
    """`rlhf-batch run` (one subprocess per stage) of 2 iterations, logging to three trackers."""
    tmp = tmp_path_factory.mktemp("tracked")
    path = write_config(
        tmp / "config.toml",
        tiny_model,
        demo_prompts,
        iterations=2,
        report_to=["tensorboard", "wandb", "mlflow"],
        tracking_project="proj",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "run", str(path), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "warning: tracking" not in done.stderr, done.stderr
    return load_config(path), done


def expected(cfg) -> dict[str, dict[int, float]]:
    """What the trackers must hold, from the run's own files: per-iteration headline numbers at
    step = iteration, and train_step/* at the global step (iteration 1 continues iteration 0)."""
    out: dict[str, dict[int, float]] = {}
    offset = 0
    for it in (0, 1):
        scores = [pq.read_table(p) for p in sorted(layout.folder(cfg.run_dir, it, "scores").glob("part-*"))]
        reward = np.concatenate([t["reward"].to_numpy() for t in scores])
        out.setdefault("scores/reward_mean", {})[it] = float(reward.mean())
        kl_sum = np.concatenate([t["kl_sum"].to_numpy() for t in scores])
        out.setdefault("scores/kl_sum_mean", {})[it] = float(kl_sum.mean())
        rollouts = pq.read_table(layout.folder(cfg.run_dir, it, "rollouts"), columns=["response_ids"])
        tokens = sum(len(r) for r in rollouts["response_ids"].to_pylist())
        out.setdefault("rollouts/response_tokens", {})[it] = float(tokens)
        adv = manifests.manifest(layout.folder(cfg.run_dir, it, "advantages"))
        out.setdefault("advantages/groups_out", {})[it] = float(adv["counts"]["groups_out"])
        roll = manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts"))
        out.setdefault("rollouts/rows", {})[it] = float(roll["rows"])
        metrics = pq.read_table(layout.folder(cfg.run_dir, it, "train") / "metrics.parquet").to_pylist()
        out.setdefault("train/steps", {})[it] = float(len(metrics))
        out.setdefault("train/loss_mean", {})[it] = float(np.mean([r["loss"] for r in metrics]))
        for row in metrics:
            out.setdefault("train_step/loss", {})[offset + row["step"]] = row["loss"]
            out.setdefault("train_step/grad_norm", {})[offset + row["step"]] = row["grad_norm"]
        offset += len(metrics)
    assert len(out["train_step/loss"]) == offset >= 2
    return out


def check(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]]) -> None:
    for key, series in want.items():
        assert key in got, f"{key} was not logged; logged: {sorted(got)[:20]}"
        assert sorted(got[key]) == sorted(series), key
        for step, value in series.items():
            assert got[key][step] == pytest.approx(value, rel=1e-6), (key, step)


@pytest.mark.slow
def test_tensorboard_holds_stage_numbers_by_iteration_and_train_steps_by_global_step(tracked_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = tracked_run
    logdir = Path(cfg.run_dir) / "tracking" / "tensorboard"
    got: dict[str, dict[int, float]] = {}
    for f in sorted(logdir.glob("events.out.tfevents.*")):  # one file per stage process
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                got.setdefault(tag, {})[e.step] = e.value
    check(got, expected(cfg))
    texts = [EventAccumulator(str(f)) for f in logdir.glob("events.out.tfevents.*")]
    for a in texts:
        a.Reload()
    config_texts = [
        a.Tensors("config/text_summary") for a in texts if "config/text_summary" in a.Tags()["tensors"]
    ]
    assert len(config_texts) == 1  # the config is attached once, by the first process
    assert '"report_to"' in config_texts[0][0].tensor_proto.string_val[0].decode()


def read_wandb(path: str) -> list:
    """The records of an offline .wandb file (leveldb log format: a 7-byte ':W&B' header, then
    32 KiB blocks of records `crc32 u32 | length u16 | type u8 | data`, type 1 full, 2-4 first,
    middle, last), each a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_same_numbers_under_one_run_id(tracked_run) -> None:
    cfg, _ = tracked_run
    files = sorted(glob.glob(str(Path(cfg.run_dir) / "tracking" / "wandb" / "offline-run-*" / "run-*.wandb")))
    # 2 iterations x (4 stage summaries + train's per-step opening), each resuming the same run
    assert len(files) == 10
    got: dict[str, dict[int, float]] = {}
    ids, names, configs = set(), set(), []
    for f in files:
        for rec in read_wandb(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                names.add((rec.run.project, rec.run.display_name))
                configs.append({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                axis = "global_step" if "global_step" in row else "iteration"
                for k, v in row.items():
                    if "/" in k:
                        got.setdefault(k, {})[int(row[axis])] = v
    assert len(ids) == 1 and names == {("proj", "run")}
    assert configs and all(c["train"]["lr"] == 1e-3 for c in configs)
    check(got, expected(cfg))


@pytest.mark.slow
def test_mlflow_file_store_holds_the_same_numbers_and_the_config(tracked_run, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    cfg, _ = tracked_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(Path(cfg.run_dir) / "tracking" / "mlruns").as_uri())
    exp = client.get_experiment_by_name("proj")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["run"]  # every stage process found the same run
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert (
        run.data.params["train.lr"] == "0.001"
        and run.data.params["report_to"] == '["tensorboard", "wandb", "mlflow"]'
    )
    want = expected(cfg)
    got = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in want}
    check(got, want)


# ---------------------------------------------------------------- failures


def test_a_tracker_that_is_not_installed_is_a_config_error_naming_the_extra(
    tmp_path, tiny_model, demo_prompts
) -> None:
    if missing_trackers(["trackio"]) is None:
        pytest.skip("trackio is installed in this venv")
    path = write_config(tmp_path / "c.toml", tiny_model, demo_prompts, report_to=["trackio"])
    with pytest.raises(
        ConfigError,
        match=r"'report_to' asks for 'trackio', which is not installed: pip install 'rlhf-batch\[trackio\]'",
    ):
        load_config(path)
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--iter", "0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "pip install 'rlhf-batch[trackio]'" in done.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_an_unknown_tracker_is_a_config_error(tmp_path, tiny_model, demo_prompts) -> None:
    path = write_config(tmp_path / "c.toml", tiny_model, demo_prompts, report_to=["comet"])
    with pytest.raises(
        ConfigError, match=r"'report_to\[0\]' must be one of 'tensorboard', 'trackio', 'wandb', 'mlflow'"
    ):
        load_config(path)


def test_tracking_keys_change_no_stage_identity(tmp_path, tiny_model, demo_prompts) -> None:
    a = load_config(write_config(tmp_path / "a.toml", tiny_model, demo_prompts))
    b = load_config(
        write_config(tmp_path / "b.toml", tiny_model, demo_prompts, report_to=["mlflow"], run_name="x")
    )
    for stage in ("generate", "import", "score", "advantage", "train"):
        assert a.identity(stage) == b.identity(stage), stage


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning_and_the_others_go_on(
    tmp_path, capsys, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # our file store in the run dir
    cfg = {"run_dir": str(tmp_path / "run"), "report_to": ["mlflow", "tensorboard"]}
    run = tracking.Run(cfg)
    assert [t.name for t in run.trackers] == ["mlflow", "tensorboard"]
    run.log({"a/x": 1.0}, 0, "iteration")
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "tracking" / "mlruns").as_uri())
    client.delete_run(run.trackers[0].run_id)  # MLflow refuses to log to a deleted run: a real failure
    run.log({"a/x": 2.0}, 1, "iteration")
    run.log({"a/x": 3.0}, 2, "iteration")
    run.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: tracking: mlflow failed (MlflowException")
    assert "off for the rest of this stage" in err[0]
    (events,) = (tmp_path / "run" / "tracking" / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a/x")] == [(0, 1.0), (1, 2.0), (2, 3.0)]


@pytest.mark.slow
def test_a_tracker_failing_during_train_leaves_the_stage_complete_and_unchanged(
    tmp_path, tiny_model, demo_prompts, monkeypatch, capsys
) -> None:
    """The same iteration without trackers and with a real TensorBoard tracker whose writes fail
    from the second call on (OSError, as on a full disk): train completes with bit-identical
    metrics (tokens_per_s aside), the tracker is dropped with one warning per opening (train's
    per-step run, then the stage summary), and what it logged before failing is intact."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    real_log, calls = tracking._TensorBoard.log, []

    def failing_log(self, metrics, step, axis):
        calls.append(step)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real_log(self, metrics, step, axis)

    monkeypatch.setattr(tracking._TensorBoard, "log", failing_log)
    results = {}
    for name, report_to in (("plain", []), ("failing", ["tensorboard"])):
        small_steps = {"lr": 1e-3, "tokens_per_step": 8}  # several optimizer steps
        path = write_config(
            tmp_path / name / "c.toml", tiny_model, demo_prompts, report_to=report_to, train=small_steps
        )
        cfg = load_config(path)
        for stage in ("generate", "score", "advantage"):
            run_stage(stage, cfg, 0, quiet=True)
        calls.clear()
        capsys.readouterr()
        results[name] = run_stage("train", cfg, 0, quiet=True)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2, warnings
    assert all(w.startswith("warning: tracking: tensorboard failed (OSError: [Errno 28]") for w in warnings)
    # train steps 0 (logged) and 1 (fails: dropped, step 2 is never sent), then the stage summary
    # at iteration 0 (a new opening, fails too)
    assert calls == [0, 1, 0]
    assert (
        results["failing"]["counts"] == results["plain"]["counts"]
        and results["plain"]["counts"]["steps"] >= 2
    )
    tables = [
        pq.read_table(tmp_path / n / "run" / "iter=0000" / "train" / "metrics.parquet") for n in results
    ]
    assert tables[1].drop(["tokens_per_s"]).equals(tables[0].drop(["tokens_per_s"]))
    assert manifests.manifest(tmp_path / "failing" / "run" / "iter=0000" / "train") is not None
    losses = []
    for events in (tmp_path / "failing" / "run" / "tracking" / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train_step/loss" in acc.Tags()["scalars"]:
            losses += [(e.step, e.value) for e in acc.Scalars("train_step/loss")]
    first = tables[1].slice(0, 1).to_pylist()[0]
    assert losses == [(0, pytest.approx(first["loss"]))]  # what was logged before the failure is intact


TRACKIO_SCRIPT = """
import json, sys
from rlhf_batch.observe import tracking
from trackio.sqlite_storage import SQLiteStorage

cfg = {"run_dir": sys.argv[1], "report_to": ["trackio"], "tracking_project": "proj", "train": {"lr": 0.001}}
for it, reward in ((0, 0.25), (1, 0.75)):  # two stage processes, each opening the run again
    run = tracking.Run(cfg)
    run.log({"scores/reward_mean": reward}, it, "iteration")
    run.close()
live = tracking.Run(cfg, step_offset=3)  # iteration 1's train: iteration 0 had 3 steps
live.log_step({"step": 0, "loss": 0.5, "lr": 0.001})
live.log_step({"step": 1, "loss": 0.125, "lr": 0.001})
live.close()
print(json.dumps({"runs": SQLiteStorage.get_runs("proj"), "logs": SQLiteStorage.get_logs("proj", "run"),
                  "config": SQLiteStorage.get_run_config("proj", "run")}))
"""


def test_trackio_local_store_holds_the_numbers_under_one_run(tmp_path: Path) -> None:
    if not TRACKIO_PY.exists():
        pytest.skip("trackio is not installed: run `make trackio` (make test does)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env.update(PYTHONPATH=str(ROOT), TRACKIO_DIR=str(tmp_path / "trackio"))
    done = subprocess.run(
        [str(TRACKIO_PY), "-c", TRACKIO_SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "warning: tracking" not in done.stderr, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]  # trackio prints notices at exit
    out = json.loads(line)
    assert out["runs"] == ["run"]  # the run_dir's folder name, reopened by each process
    got: dict[str, dict[int, float]] = {}
    for row in out["logs"]:
        for k, v in row.items():
            if "/" in k:
                got.setdefault(k, {})[row["step"]] = v
    # summaries at step = iteration; train steps at 3 + step (the earlier iteration's 3 steps)
    assert got == {
        "scores/reward_mean": {0: 0.25, 1: 0.75},
        "train_step/loss": {3: 0.5, 4: 0.125},
        "train_step/lr": {3: 0.001, 4: 0.001},
    }
    assert out["config"]["train.lr"] == "0.001" and out["config"]["report_to"] == '["trackio"]'
