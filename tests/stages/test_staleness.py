"""max_staleness = S: iteration K samples from the policy of iteration K-1-S, recorded in the
rollouts and their manifest, shown by status and the report, kept by retention; with S > 0
train defaults to the decoupled objective (the loss itself: tests/core/test_losses.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import Config
from rlhf_batch.core.staleness import sampling_start, staleness
from rlhf_batch.errors import ConfigError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.models.policy import sampling_policy, start_policy
from rlhf_batch.models.tiny import init_model
from rlhf_batch.observe.report import write_report
from rlhf_batch.stages.importer import import_rollouts
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests, output, retention
from rlhf_batch.store.schemas import ROLLOUTS
from tests.store.test_retention import fake_policy


def test_sampling_iteration_and_staleness_by_hand() -> None:
    # K - S clipped at 0; staleness = K - that = min(S, K)
    assert [sampling_start(k, 0) for k in range(5)] == [0, 1, 2, 3, 4]  # lock-step: its own start
    assert [sampling_start(k, 1) for k in range(5)] == [0, 0, 1, 2, 3]
    assert [sampling_start(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [staleness(k, 0) for k in range(5)] == [0, 0, 0, 0, 0]
    assert [staleness(k, 2) for k in range(5)] == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="max_staleness"):
        sampling_start(3, -1)


def test_stale_runs_default_to_the_decoupled_objective_unless_set(make_config) -> None:
    def objective(**top: object) -> tuple[object, object]:
        tc = make_config(**top)[1].train
        return tc.recompute_old, tc.tis_cap

    assert objective() == (False, 0.0)  # lock-step: the defaults of before, also in the identity
    ident = Config().identity("train")["train"]
    assert json.dumps([ident["recompute_old"], ident["tis_cap"]]) == "[false, 0.0]"  # as recorded before
    assert "max_staleness" not in Config().identity("generate")  # decides through the policy input
    assert objective(max_staleness=1) == (True, 5.0)  # AReaL's cap (config.STALE_TIS_CAP)
    assert objective(max_staleness=2, train={"tis_cap": 2}) == (True, 2.0)  # a set value wins
    assert objective(max_staleness=1, train={"recompute_old": False}) == (False, 0.0)  # no anchor
    assert objective(train={"tis_cap": 3}) == (False, 3.0)
    with pytest.raises(ConfigError, match="'keep_policies' must be 0 or > max_staleness"):
        make_config(max_staleness=1, keep_policies=1)


def _trained(cfg, it: int, seed: int) -> Path:
    """A real model in iteration `it`'s policy place and its train complete."""
    pol = layout.policy_dir(cfg.run_dir, it)
    init_model(pol, seed=seed)
    output.claim(layout.folder(cfg.run_dir, it, "train"), "train", {"test": it}, {}).finish(0)
    return pol


def _rollouts(cfg, it: int) -> list[dict]:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "rollouts"), ROLLOUTS).to_pylist()


def test_generate_samples_from_the_policy_max_staleness_iterations_back(make_config) -> None:
    _, cfg = make_config(max_staleness=1, generate={"prompts_per_part": 12, "max_new_tokens": 4})
    pol0 = _trained(cfg, 0, seed=7)
    _trained(cfg, 1, seed=8)
    assert [sampling_policy(cfg, k) for k in (0, 1, 2)] == [cfg.policy_model, cfg.policy_model, str(pol0)]
    m1, m2 = (run_stage("generate", cfg, k, quiet=True) for k in (1, 2))
    assert (m1["policy_iteration"], m1["staleness"]) == (-1, 1)  # the initial policy, one update behind
    assert (m2["policy_iteration"], m2["staleness"]) == (0, 1)
    assert {r["policy"] for r in _rollouts(cfg, 1)} == {cfg.policy_model}  # outside the run: as is
    rows = _rollouts(cfg, 2)
    assert {r["policy"] for r in rows} == {"iter=0000/policy"}  # not iter=0001 (what K-1 would be)
    # the behaviour log-probs are iteration 0's policy's, not iteration 1's
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows[:4]]
    lens = [len(r["prompt_ids"]) for r in rows[:4]]
    beh = [torch.tensor(r["behavior_logprobs"]) for r in rows[:4]]
    for it, same in ((0, True), (1, False)):
        model = load_model(str(layout.policy_dir(cfg.run_dir, it)), "policy", dtype="float32")
        with torch.no_grad():
            lp, mask, _ = response_logprobs(model, seqs, lens, cfg.generate.temperature, pad_id=1)
        assert all(torch.allclose(lp[i][mask[i]], b, atol=1e-5) for i, b in enumerate(beh)) == same


def test_lock_step_samples_from_the_start_policy_as_before(make_config) -> None:
    _, cfg = make_config()
    for it, seed in ((0, 7), (1, 8), (2, 9)):
        _trained(cfg, it, seed)
    assert [sampling_policy(cfg, k) for k in range(4)] == [start_policy(cfg, k) for k in range(4)]
    m = run_stage("generate", cfg, 2, quiet=True)
    assert (m["policy_iteration"], m["staleness"]) == (1, 0)
    assert {r["policy"] for r in _rollouts(cfg, 2)} == {"iter=0001/policy"}


def test_import_takes_behaviour_logprobs_from_the_sampling_policy(make_config, tmp_path: Path) -> None:
    # iteration 1 with S = 1: no train of iteration 0 is needed, the initial policy sampled it
    _, cfg = make_config(max_staleness=1)
    rows = tmp_path / "ext.jsonl"
    rows.write_text(json.dumps({"prompt": "a*2=", "response": "aa"}) + "\n")
    m = import_rollouts(cfg, rows, 1, quiet=True)
    assert (m["policy_iteration"], m["staleness"]) == (-1, 1)
    assert {r["policy"] for r in _rollouts(cfg, 1)} == {cfg.policy_model}


def test_retention_keeps_every_policy_a_lagging_generate_samples_from(make_config, tmp_path: Path) -> None:
    _, cfg = make_config(max_staleness=1, keep_policies=2, run_dir=str(tmp_path / "run"))
    for it in range(4):
        fake_policy(Path(cfg.run_dir), it, True)
    # train 3 complete: generates still to run are 4 (samples from 2) and 5 (from 3), kept
    assert retention.prune(cfg, 3) == [0, 1]
    assert all(Path(sampling_policy(cfg, k)).is_dir() for k in (4, 5))
    # keep_policies = S (refused by the config, set here behind its back): policy 2 would go
    _, short = make_config(max_staleness=1, run_dir=str(tmp_path / "short"))
    for it in range(4):
        fake_policy(Path(short.run_dir), it, True)
    short.keep_policies = 1
    assert retention.prune(short, 3) == [0, 1, 2]
    assert not Path(sampling_policy(short, 4)).is_dir()


@pytest.mark.slow
def test_a_stale_run_records_and_shows_its_staleness(make_config, tmp_path: Path) -> None:
    """Multi-turn (an environment), so the lanes run the turn loop and train its masked rows."""
    env = {"environment": "rlhf_batch.envs.demo:ask_letter", "max_turns": 2}
    path, cfg = make_config(
        iterations=3,
        max_staleness=1,
        in_process=True,
        threads=1,
        train={"lr": 1e-3, "tokens_per_step": 256},
        generate=env,
        score={"reward_functions": ["rlhf_batch.rewards.demo:ask_letter"]},
    )
    run_pipeline(path, [], quiet=True)
    by_iter = {it: manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts")) for it in range(3)}
    assert [(m["policy_iteration"], m["staleness"]) for m in by_iter.values()] == [(-1, 0), (-1, 1), (0, 1)]
    for it, m in by_iter.items():  # trajectories of two turns, the letter revealed between them
        assert m["counts"]["turns"] > m["rows"] and m["counts"]["env_errors"] == 0
        t = pq.read_table(layout.folder(cfg.run_dir, it, "rollouts"), columns=["loss_mask", "turn_roles"])
        assert ["assistant", "user", "assistant"] in t.column("turn_roles").to_pylist()
        # the decoupled objective (recompute_old, tis_cap) trains the sampled tokens only (1 epoch)
        adv = pq.read_table(layout.folder(cfg.run_dir, it, "advantages"), columns=["loss_mask"])
        sampled = sum(map(sum, adv.column("loss_mask").to_pylist()))
        metrics = pq.read_table(layout.folder(cfg.run_dir, it, "train") / "metrics.parquet")
        assert sum(metrics.column("tokens").to_pylist()) == sampled < len(pc.list_flatten(adv["loss_mask"]))
    policy = pq.read_table(layout.folder(cfg.run_dir, 2, "rollouts"), columns=["policy"])
    assert set(policy.column("policy").to_pylist()) == {"iter=0000/policy"}
    train = manifests.manifest(layout.folder(cfg.run_dir, 2, "train"))
    assert train["resolved_config"]["train"]["recompute_old"] is True
    assert train["resolved_config"]["train"]["tis_cap"] == 5.0
    res = CliRunner().invoke(app, ["status", "--run-dir", cfg.run_dir])
    assert res.exit_code == 0, res.output
    lines = [line.split() for line in res.stdout.splitlines()]
    stale = lines[1].index("stale")
    assert [w[stale] for w in lines[2:] if w[1] == "rollouts"] == ["0", "1", "1"]
    assert {w[stale] for w in lines[2:] if w[1] != "rollouts"} == {"-"}
    write_report(cfg.run_dir, tmp_path / "report")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert [r["staleness"] for r in summary] == [0, 1, 1]
    assert "<th>staleness</th>" in (tmp_path / "report" / "report.html").read_text()
