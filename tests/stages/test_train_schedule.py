"""The LR schedule's length is fixed once per run (RUN_DIR/schedule.json): stage commands run
with `iterations` at its default cannot shorten it silently, it is part of train's identity under
a decaying schedule, and `run --set train.total_steps=N` extends a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.errors import StageError
from rlhf_batch.stages.executor import output_of
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train.stage import Train
from rlhf_batch.store import layout
from rlhf_batch.store.layout import SCHEDULE as RECORD
from tests.stages.test_train import make_table, metrics, train_toml, write_advantages

# 8 rows, 8 tokens per step: 4 steps an iteration; linear decay, no warmup
KEYS = dict(lr=1e-2, lr_schedule="linear", tokens_per_step=8, max_tokens_per_batch=64)


def test_stage_commands_with_default_iterations_cannot_train_past_the_schedule(
    make_config, tiny_model: Path
) -> None:
    """As the Airflow DAG runs them (iterations left at 1): the schedule is 1 x 4 steps; iteration 1
    would train at lr 0 with the identity of a run at the right rates, so it is refused."""
    _, cfg = make_config(train_toml(**KEYS))
    for it in (0, 1):
        write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8, seed=it), iteration=it)
    run_stage("train", cfg, 0, quiet=True)
    record = Path(cfg.run_dir) / RECORD
    assert json.loads(record.read_text())["total_steps"] == 4
    with pytest.raises(StageError, match=rf"schedule ended at step 4 \({record}\).*train.total_steps"):
        run_stage("train", cfg, 1, quiet=True)
    assert not layout.folder(cfg.run_dir, 1, "train").exists()
    # extended on purpose: 8 steps; iteration 1 at the run's steps 4..7: lr 1e-2 x (1 - s / 8)
    _, longer = make_config(train_toml(**KEYS, total_steps=8), name="longer.toml")
    run_stage("train", longer, 1, quiet=True)
    assert metrics(cfg.run_dir, 1).column("lr").to_pylist() == pytest.approx([5e-3, 3.75e-3, 2.5e-3, 1.25e-3])
    assert json.loads(record.read_text())["changed"] == [{"from_iteration": 1, "total_steps": 8}]


def test_the_length_is_part_of_train_identity_under_a_decaying_schedule(
    make_config, tiny_model: Path
) -> None:
    _, one = make_config(train_toml(**KEYS), iterations=1)
    # the input prepare reads
    write_advantages(one.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), iteration=0)
    _, three = make_config(train_toml(**KEYS), name="three.toml", iterations=3)
    assert output_of(Train(one, 0)).identity["config"] != output_of(Train(three, 0)).identity["config"]
    _, flat1 = make_config(train_toml(**{**KEYS, "lr_schedule": "constant"}), name="f1.toml", iterations=1)
    _, flat3 = make_config(train_toml(**{**KEYS, "lr_schedule": "constant"}), name="f3.toml", iterations=3)
    # the length changes nothing
    assert output_of(Train(flat1, 0)).identity["config"] == output_of(Train(flat3, 0)).identity["config"]


@pytest.mark.slow
def test_run_extends_a_run_with_train_total_steps(make_config) -> None:
    """The README's advice: a run with a decaying schedule extended by `--set train.total_steps=N`
    (and more iterations) goes on; its complete iterations stay complete."""
    path, cfg = make_config(
        train_toml(lr=1e-2, lr_schedule="linear"), iterations=2, in_process=True, threads=1
    )
    run_pipeline(path, [], quiet=True)
    fixed = json.loads((Path(cfg.run_dir) / RECORD).read_text())
    before = (layout.folder(cfg.run_dir, 1, "train") / layout.MANIFEST).read_bytes()
    steps = fixed["total_steps"] // 2
    run_pipeline(path, ["iterations=3", f"train.total_steps={3 * steps}"], quiet=True)
    assert (layout.folder(cfg.run_dir, 1, "train") / layout.MANIFEST).read_bytes() == before  # not redone
    lrs = metrics(cfg.run_dir, 2).column("lr").to_pylist()
    assert lrs and all(lr > 0 for lr in lrs)  # the old length (2 x steps) would give lr 0 throughout
    assert json.loads((Path(cfg.run_dir) / RECORD).read_text())["changed"] == [
        {"from_iteration": 2, "total_steps": 3 * steps}
    ]


def test_a_train_folder_written_before_the_record_stays_complete(make_config, tiny_model: Path) -> None:
    """Runs written before schedule.json (identity: the configured total_steps, 0) keep their
    complete train folders."""
    _, cfg = make_config(train_toml(**KEYS))
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), iteration=0)
    m = run_stage("train", cfg, 0, quiet=True)
    assert m["config"]["train"]["total_steps"] == "1 iterations"
    # as an older version wrote it: total_steps 0 in the identity, no record
    from rlhf_batch.stages.executor import is_done

    (Path(cfg.run_dir) / RECORD).unlink()
    sdir = layout.folder(cfg.run_dir, 0, "train")
    legacy = Train(cfg, 0)
    man = json.loads((sdir / layout.MANIFEST).read_text())
    man["config"]["train"]["total_steps"] = 0
    (sdir / layout.MANIFEST).write_text(json.dumps(man))
    out = output_of(legacy)
    assert out.identity["config"]["train"]["total_steps"] == 0
    man["key"] = out.key  # the key that older version computed for it
    (sdir / layout.MANIFEST).write_text(json.dumps(man))
    assert is_done(Train(cfg, 0))
