"""The eval stage: held-out samples from iteration K's starting policy, rewards, metrics per data
source in the manifest; resume after a kill, refusal of a changed config, `run`'s schedule."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_batch.config import load_config
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.models.tiny import init_model
from rlhf_batch.runtime import faults
from rlhf_batch.stages.evaluate import Eval
from rlhf_batch.stages.executor import execute
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import EVAL

PARITY = "tests.stages.test_eval:parity"


def parity(*, response_ids: list[list[int]], **_: object) -> list[float]:
    """1.0 for a response whose token ids have an even sum, else 0.0: a 0/1 reward that splits the
    tiny model's samples (its text lengths are mostly even: 6 characters, special tokens kept)."""
    return [1.0 if sum(r) % 2 == 0 else 0.0 for r in response_ids]


def carried_value(*, value: list[float], **_: object) -> list[float]:
    """The prompt's own `value` column, whatever the response: every sample of a prompt scores the same."""
    return list(value)


def eval_prompts(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


FIVE = [
    {"id": f"h{i}", "prompt": f"{'abcde'[i]}*{i + 1}=", "data_source": "left" if i < 3 else "right"}
    for i in range(5)
]


def eval_rows(cfg, it: int = 0) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "eval"), EVAL)


def run_eval(cfg, it: int = 0, **kw) -> dict:
    return execute(Eval(cfg, it), quiet=True, **kw)


def test_parts_and_manifest_metrics_per_data_source(make_config, tmp_path: Path) -> None:
    data = eval_prompts(tmp_path, FIVE)
    _, cfg = make_config(
        eval={"prompts": data, "n": 4, "k": [1, 2, 4], "prompts_per_part": 2, "reward_functions": [PARITY]}
    )
    m = run_eval(cfg)
    t = eval_rows(cfg)
    assert m["rows"] == t.num_rows == 5 * 4 and len(m["parts"]) == 3  # ceil(5 prompts / 2 per part)
    assert t["rollout_id"].to_pylist()[:2] == ["0000-h0-0", "0000-h0-1"]
    rows = t.to_pylist()
    for (
        r
    ) in rows:  # the reward is the function's value, correct is reward >= 1.0, the policy is iteration 0's
        assert r["reward"] == r["reward_parity"] == parity(response_ids=[r["response_ids"]])[0]
        assert r["correct"] == (r["reward"] >= 1.0) and r["policy"] == cfg.policy_model
        assert len(r["behavior_logprobs"]) == len(r["response_ids"]) <= 6
    # the metrics recomputed from the rows with the binomial form of pass@k (math.comb)
    n = 4
    expected: dict[str, dict[str, float]] = {}
    for source in ("left", "right"):
        per_prompt = []
        for pid in sorted({r["prompt_id"] for r in rows if r["data_source"] == source}):
            rewards = [r["reward"] for r in rows if r["prompt_id"] == pid]
            c = sum(x >= 1.0 for x in rewards)
            per_prompt.append(
                {"mean@4": sum(rewards) / n, "best@4": max(rewards)}
                | {f"pass@{k}": 1 - math.comb(n - c, k) / math.comb(n, k) for k in (1, 2, 4)}
            )
        expected[source] = {k: sum(p[k] for p in per_prompt) / len(per_prompt) for k in per_prompt[0]}
        expected[source]["prompts"] = len(per_prompt)
    assert m["metrics"].keys() == expected.keys()
    for source, values in expected.items():
        assert m["metrics"][source] == pytest.approx(values, abs=1e-12), source
    assert m["overall"]["prompts"] == 5 and m["prompts_unscored"] == 0
    assert 0 < m["overall"]["mean@4"] < 1  # the parity reward does split the samples
    assert m["counts"]["samples"] == 20 and m["counts"]["unscored"] == 0


def test_constant_rewards_give_hand_worked_metrics_and_one_group_without_data_source(
    make_config, tmp_path: Path
) -> None:
    rows = [
        {"id": "p0", "prompt": "a*1=", "value": 1.0},
        {"id": "p1", "prompt": "b*1=", "value": 0.0},
        {"id": "p2", "prompt": "c*1=", "value": 0.5},
    ]
    table = {
        "prompts": eval_prompts(tmp_path, rows),
        "n": 3,
        "k": [1, 3],
        "reward_functions": ["tests.stages.test_eval:carried_value"],
    }
    _, cfg = make_config(eval=table)
    m = run_eval(cfg)
    # threshold 1.0: p0 has c = 3 of n = 3 correct, p1 and p2 none (0.5 < 1.0).
    # pass@k per prompt: 1 - C(3-c, k)/C(3, k) = 1 for p0 (C(0, k) = 0), 0 for p1, p2 (C(3, k)/C(3, k) = 1)
    # mean@3 = (1 + 0 + 0.5) / 3 = 0.5; best@3 = (1 + 0 + 0.5) / 3 = 0.5; pass@1 = pass@3 = 1/3
    assert m["metrics"] == {
        "all": {
            "mean@3": 0.5,
            "best@3": 0.5,
            "pass@1": pytest.approx(1 / 3),
            "pass@3": pytest.approx(1 / 3),
            "prompts": 3.0,
        }
    }
    _, lower = make_config(name="t.toml", eval={**table, "correct_threshold": 0.5})
    m = run_eval(lower, force=True)
    # threshold 0.5: p2 is correct too: pass@k = (1 + 0 + 1) / 3 = 2/3
    assert m["metrics"]["all"]["pass@1"] == pytest.approx(2 / 3) and m["correct_threshold"] == 0.5


def test_iteration_k_evaluates_the_policy_iteration_k_starts_from(make_config, tmp_path: Path) -> None:
    _, cfg = make_config(eval={"prompts": eval_prompts(tmp_path, FIVE), "n": 2, "reward_functions": [PARITY]})
    with pytest.raises(StageError, match="iteration 0 has no trained policy"):
        run_eval(cfg, 1)
    prev = layout.policy_dir(cfg.run_dir, 0)
    init_model(prev, seed=7)  # another real model in train's output place
    output.claim(layout.folder(cfg.run_dir, 0, "train"), "train", {"test": True}, {}).finish(0)
    m = run_eval(cfg, 1)
    t = eval_rows(cfg, 1)
    # the rows name it relative to the run directory (a run can be moved)
    assert m["policy"] == str(prev) and set(t["policy"].to_pylist()) == {"iter=0000/policy"}
    assert t["rollout_id"].to_pylist()[0] == "0001-h0-0"
    assert not layout.folder(cfg.run_dir, 1, "rollouts").exists()  # eval wrote only its own folder


def test_own_sampling_settings_and_score_reward_functions_by_default(make_config, tmp_path: Path) -> None:
    data = eval_prompts(tmp_path, [{"prompt": "a*3=", "letter": "a", "count": 3}])
    _, hot = make_config(eval={"prompts": data, "n": 8, "temperature": 3.0, "max_new_tokens": 3})
    m = run_eval(hot)
    t = eval_rows(hot)
    assert "reward_letter_count" in t.column_names  # score.reward_functions, called as score calls it
    assert max(len(x) for x in t["response_ids"].to_pylist()) <= 3  # eval.max_new_tokens, not generate's 6
    assert m["resolved_config"]["eval"]["temperature"] == 3.0
    _, cold = make_config(
        run_dir=str(tmp_path / "cold"), name="c.toml", eval={"prompts": data, "n": 8, "temperature": 0.05}
    )
    run_eval(cold)
    # at temperature 0.05 sampling is nearly greedy: the 8 samples agree; at 3.0 they do not
    assert len(set(map(tuple, eval_rows(cold)["response_ids"].to_pylist()))) == 1
    assert len(set(map(tuple, t["response_ids"].to_pylist()))) > 1


def test_a_training_prompt_does_not_get_generates_samples_again(make_config, demo_prompts: Path) -> None:
    from rlhf_batch.store.schemas import ROLLOUTS

    # eval on the training prompts with generate's sampling settings (temperature 1, 6 new tokens, G = n = 4)
    _, cfg = make_config(eval={"prompts": str(demo_prompts), "n": 4, "reward_functions": [PARITY]})
    run_stage("generate", cfg, 0, quiet=True)
    run_eval(cfg)
    gen = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS).to_pylist()
    ev = eval_rows(cfg).to_pylist()
    assert [r["rollout_id"] for r in gen] == [r["rollout_id"] for r in ev]  # the same ids, 48 of them
    same = sum(g["response_ids"] == e["response_ids"] for g, e in zip(gen, ev, strict=True))
    assert same < len(gen) // 2  # other draws (a 6-token sample of the random model rarely repeats)


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_rows_and_metrics_of_an_uninterrupted_run(
    make_config, tmp_path: Path
) -> None:
    data = eval_prompts(tmp_path, FIVE)
    table = {"prompts": data, "n": 3, "k": [1, 2], "prompts_per_part": 2, "reward_functions": [PARITY]}
    path, cfg = make_config(eval=table)
    cmd = [sys.executable, "-m", "rlhf_batch", "eval", str(path), "--quiet"]
    env = {**os.environ, faults.FAULT_ENV: "eval:part-1:tmp", "PYTHONPATH": str(Path(__file__).parents[2])}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    sdir = layout.folder(cfg.run_dir, 0, "eval")
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0)]
    assert not (sdir / layout.MANIFEST).exists()
    env.pop(faults.FAULT_ENV)
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    _, clean = make_config(run_dir=str(tmp_path / "clean"), name="clean.toml", eval=table)
    m_clean = run_eval(clean)
    assert eval_rows(cfg).to_pylist() == eval_rows(clean).to_pylist()
    m = manifests.manifest(sdir)
    assert m["metrics"] == m_clean["metrics"] and m["overall"] == m_clean["overall"]
    assert not list(sdir.glob(".*.tmp"))


def test_a_changed_config_is_refused_and_force_replaces(make_config, tmp_path: Path) -> None:
    table = {"prompts": eval_prompts(tmp_path, FIVE), "n": 2, "reward_functions": [PARITY]}
    _, cfg = make_config(eval=table)
    run_eval(cfg)
    _, again = make_config(name="same.toml", eval=table, generate={"temperature": 0.5})
    run_eval(again)  # generate's temperature is not eval's: nothing to redo
    _, changed = make_config(name="b.toml", eval={**table, "temperature": 0.5})
    with pytest.raises(
        StageError, match=r"complete with a different config .*eval.temperature: 1.0 on disk, 0.5 now"
    ):
        run_eval(changed)
    _, fewer = make_config(name="c.toml", eval={**table, "reward_functions": []})
    with pytest.raises(StageError, match="reward_functions"):  # score's functions now: another result
        run_eval(fewer)
    m = run_eval(changed, force=True)
    assert m["resolved_config"]["eval"]["temperature"] == 0.5


def test_bad_eval_settings_are_named(make_config, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'eval.k' has k = 8; pass@k needs 1 <= k <= eval.n = 4"):
        make_config(eval={"k": [1, 8]})
    _, cfg = make_config(name="n.toml")
    with pytest.raises(StageError, match=r"eval.prompts: no held-out prompt file configured"):
        run_eval(cfg)
    _, cfg = make_config(name="m.toml", eval={"prompts": str(tmp_path / "missing.jsonl")})
    with pytest.raises(StageError, match=r"missing.jsonl: prompt file not found"):
        run_eval(cfg)
    clash = eval_prompts(tmp_path, [{"prompt": "a*1=", "correct": True}])
    _, cfg = make_config(name="c.toml", eval={"prompts": clash})
    with pytest.raises(StageError, match=r"heldout.jsonl: column 'correct' clashes with an eval column"):
        run_eval(cfg)
    assert not layout.folder(cfg.run_dir, 0, "eval").joinpath(layout.MANIFEST).exists()


@pytest.mark.parametrize(
    ("iterations", "every", "expected"),
    [(3, 0, [0, 3]), (5, 2, [0, 2, 4, 5]), (4, 2, [0, 2, 4]), (2, 1, [0, 1, 2])],
)
def test_run_schedule(make_config, tmp_path: Path, iterations: int, every: int, expected: list[int]) -> None:
    _, cfg = make_config(iterations=iterations, eval={"prompts": "x.jsonl", "every": every})
    assert [it for it in range(iterations + 2) if Eval.runs_at(cfg, it)] == expected
    _, off = make_config(name="off.toml", iterations=iterations)
    assert not any(Eval.runs_at(off, it) for it in range(iterations + 2))  # no [eval] prompts: no eval


def test_config_paths_of_eval_prompts_are_resolved_like_generates(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.toml"
    path.write_text('[eval]\nprompts = "held.jsonl"\n')
    assert load_config(path).eval.prompts == str(tmp_path / "sub" / "held.jsonl")


def test_run_evaluates_baseline_every_and_after_the_last_then_status_sql_report(
    make_config, tmp_path: Path, capsys
) -> None:
    """Three in-process iterations with eval.every = 2: eval at 0 (baseline), 2, and 3 (the policy
    the last train wrote), not at 1; each from the policy its iteration starts from."""
    import re

    from rlhf_batch.commands.pipeline import run_pipeline
    from rlhf_batch.core.eval_metrics import with_overall
    from rlhf_batch.observe.query import connect
    from rlhf_batch.observe.report import write_report
    from rlhf_batch.observe.status import print_status

    table = {
        "prompts": eval_prompts(tmp_path, FIVE),
        "n": 2,
        "k": [1, 2],
        "every": 2,
        "reward_functions": [PARITY],
    }
    path, cfg = make_config(iterations=3, in_process=True, train={"lr": 1e-2}, eval=table)
    capsys.readouterr()
    run_pipeline(path, [], quiet=True)
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [line.split()[1:3] for line in summary] == [
        [str(it), s] for it in (0, 2, 3) for s in ("left:", "right:", "overall:")
    ]
    done = [it for it in range(5) if manifests.manifest(layout.folder(cfg.run_dir, it, "eval"))]
    assert done == [0, 2, 3]
    assert manifests.manifest(layout.folder(cfg.run_dir, 3, "rollouts")) is None  # only eval at 3
    policies = [manifests.manifest(layout.folder(cfg.run_dir, it, "eval"))["policy"] for it in done]
    assert policies == [
        cfg.policy_model,
        str(layout.policy_dir(cfg.run_dir, 1)),
        str(layout.policy_dir(cfg.run_dir, 2)),
    ]
    before = {str(p): p.stat().st_mtime_ns for p in Path(cfg.run_dir).glob("iter=*/*/_manifest.json")}
    run_pipeline(path, [], quiet=True)  # again: nothing to do
    assert {str(p): p.stat().st_mtime_ns for p in Path(cfg.run_dir).glob("iter=*/*/_manifest.json")} == before

    con = connect(cfg.run_dir)
    got = con.sql(
        "SELECT iter, count(*), avg(reward), avg(correct::DOUBLE) FROM eval GROUP BY iter ORDER BY iter"
    ).fetchall()
    con.close()
    assert [g[:2] for g in got] == [(0, 10), (2, 10), (3, 10)]
    for it, _, mean, share in got:
        m = manifests.manifest(layout.folder(cfg.run_dir, it, "eval"))
        assert mean == pytest.approx(m["overall"]["mean@2"]) and share == pytest.approx(
            m["overall"]["pass@1"]
        )

    con = connect(cfg.run_dir)
    long = con.sql("SELECT iter, data_source, metric, value FROM eval_metrics ORDER BY ALL").fetchall()
    con.close()
    from_manifests = sorted(
        (it, source, metric, float(v))
        for it in (0, 2, 3)
        for source, values in with_overall(manifests.manifest(layout.folder(cfg.run_dir, it, "eval"))).items()
        for metric, v in values.items()
    )
    assert (
        long == from_manifests and len(long) == 3 * 3 * 5
    )  # iterations x (2 sources + overall) x (mean, best, pass@1, pass@2, prompts)

    capsys.readouterr()
    print_status(cfg.run_dir)
    status = capsys.readouterr().out
    eval_lines = [line for line in status.splitlines() if re.match(r"\s*\d+\s+eval\s", line)]
    assert [line.split()[0] for line in eval_lines] == ["0", "2", "3"]
    m0 = manifests.manifest(layout.folder(cfg.run_dir, 0, "eval"))["metrics"]
    assert f"left: mean@2 {m0['left']['mean@2']:.4g} pass@1" in eval_lines[0]
    assert f"right: mean@2 {m0['right']['mean@2']:.4g}" in eval_lines[0] and "pass@2" in eval_lines[0]

    page = write_report(cfg.run_dir, tmp_path / "out").read_bytes().decode()
    png = (tmp_path / "out" / "eval.png").read_bytes()
    assert (
        png[:4] == b"\x89PNG" and int.from_bytes(png[16:20], "big") == 1350
    )  # 2 sources + overall, 15 x 3.2 in
    assert '<img src="eval.png"' in page
    section = page.split("Held-out completions by iteration")[1]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", section)
    assert [(int(r[0]), r[1]) for r in rows] == [(it, f"h{i}") for it in (0, 2, 3) for i in range(5)]
    t0 = eval_rows(cfg, 0).to_pylist()
    for _, pid, reward, correct in rows[:5]:
        r = next(x for x in t0 if x["prompt_id"] == pid and x["sample_idx"] == 0)
        assert float(reward) == pytest.approx(r["reward"]) and correct == str(r["correct"])


def test_eval_views_of_a_run_without_eval_are_empty(tmp_path: Path) -> None:
    from rlhf_batch.observe.query import connect

    con = connect(tmp_path)
    assert con.sql("SELECT count(*) FROM eval").fetchall() == [(0,)]
    assert con.sql("SELECT iter, data_source, metric, value FROM eval_metrics").fetchall() == []
    assert "correct" in [d[0] for d in con.sql("SELECT * FROM eval").description]
    con.close()


def test_cli_if_due_evaluates_only_where_run_would(make_config, tmp_path: Path) -> None:
    """The Airflow DAG's eval tasks: `--if-due` is a no-op (exit 0, nothing written) where `run`
    would not evaluate, and evaluates where it would."""
    from typer.testing import CliRunner

    from rlhf_batch.commands.cli import app

    runner = CliRunner()
    off, cfg = make_config(name="off.toml", iterations=2)
    res = runner.invoke(app, ["eval", str(off), "--iter", "0", "--if-due", "--quiet"])
    assert res.exit_code == 0 and not Path(cfg.run_dir).exists()  # no [eval] prompts: nothing
    table = {"prompts": eval_prompts(tmp_path, FIVE[:2]), "n": 2, "reward_functions": [PARITY]}
    on, cfg = make_config(iterations=2, eval=table)
    res = runner.invoke(app, ["eval", str(on), "--iter", "1", "--if-due", "--quiet"])
    assert res.exit_code == 0 and not layout.iter_dir(cfg.run_dir, 1).exists()  # every = 0: not at 1
    res = runner.invoke(app, ["eval", str(on), "--iter", "0", "--if-due", "--quiet"])
    assert res.exit_code == 0, res.output
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "eval"))["rows"] == 4


def eval_as_the_cli_does(config: str | Path) -> dict:
    from rlhf_batch.runtime import dist

    cfg = load_config(config)
    dist.init(cfg.device)
    return run_eval(cfg)


@pytest.mark.slow
def test_two_ranks_write_the_rows_and_metrics_of_one(make_config, tmp_path: Path) -> None:
    """torchrun with 2 CPU processes (gloo): rank r writes parts r, r + 2, ...; rank 0 the
    manifest, whose metrics are those of one process."""
    import torch

    table = {"prompts": eval_prompts(tmp_path, FIVE), "n": 3, "k": [1, 3], "prompts_per_part": 2}
    path, two = make_config(run_dir=str(tmp_path / "two"), eval={**table, "reward_functions": [PARITY]})
    _, one = make_config(
        run_dir=str(tmp_path / "one"), name="one.toml", eval={**table, "reward_functions": [PARITY]}
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([*cmd, __file__, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1)
    try:
        m_one = run_eval(one)
    finally:
        torch.set_num_threads(threads)
    m_two = manifests.manifest(layout.folder(two.run_dir, 0, "eval"))
    assert {p["file"][5:10] for p in m_two["parts"]} == {"00000", "00001"}  # part-RRRRR-: both ranks
    assert len(m_two["parts"]) == 3  # ceil(5 prompts / 2 per part)
    a, b = (eval_rows(c).sort_by("rollout_id").to_pylist() for c in (two, one))
    assert len(a) == 15 and a == b  # every column, floats bit for bit
    assert m_two["metrics"] == m_one["metrics"] and m_two["overall"] == m_one["overall"]


if __name__ == "__main__":  # a torchrun rank
    import torch

    torch.set_num_threads(1)
    eval_as_the_cli_does(sys.argv[1])


def test_verl_and_trl_reward_functions_score_eval_as_they_score_score(make_config) -> None:
    data = Path(__file__).parent.parent / "fixtures" / "verl_math.parquet"
    verl, trl = "verl:tests.stages.test_ecosystem:compute_score", "trl:tests.stages.test_ecosystem:trl_reward"
    _, cfg = make_config(
        eval={
            "prompts": str(data),
            "n": 2,
            "k": [1, 2],
            "reward_functions": [verl, trl],
            "reward_weights": [1.0, 0.0],
        }
    )
    m = run_eval(cfg)
    rows = eval_rows(cfg).to_pylist()
    # compute_score's score is the prompt's extra_info.index (prompts 0..3, two samples each);
    # trl_reward is len(completion_ids), weighted 0: reward = index
    assert [r["reward_compute_score"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert [r["reward_trl_reward"] for r in rows] == [float(len(r["response_ids"])) for r in rows]
    assert [r["reward"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert [r["correct"] for r in rows] == [False, False] + [True] * 6  # reward >= 1.0
    # the verl dict's other keys are columns, as in scores: acc = index is even, pred = response[:2]
    assert [r["reward_compute_score_acc"] for r in rows] == [True, True, False, False] * 2
    assert [r["reward_compute_score_pred"] for r in rows] == [r["response"][:2] for r in rows]
    # one data source: mean@2 = best@2 = (0 + 1 + 2 + 3) / 4 = 1.5; prompt 0 has c = 0 of 2
    # correct, the others c = 2: pass@1 = pass@2 = (0 + 1 + 1 + 1) / 4 = 0.75
    assert m["metrics"] == {
        "example/frac": {"mean@2": 1.5, "best@2": 1.5, "pass@1": 0.75, "pass@2": 0.75, "prompts": 4.0}
    }
