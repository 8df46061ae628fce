"""`rlhf-batch audit`: stored rollouts re-scored with score.audit_functions into iter=K/audit,
nothing else touched; idempotent, refused under another list without --force; the `audit` view
joins rollouts and scores; with the reward cache, verdicts score computed are reused."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from rlhf_batch.errors import ConfigError, StageError, UserError
from rlhf_batch.observe.query import connect, run_sql
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import AUDIT
from tests.stages.cli_helpers import cli
from tests.stages.test_score import HERE, write_rollouts

EXACT = "rlhf_batch.rewards.demo:letter_count"


def ends_with_letter(*, responses: list[str], letter: list[str], **_: object) -> list[float | None]:
    return [None if r == "zz" else float(r.endswith(x)) for r, x in zip(responses, letter, strict=True)]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_audit_writes_its_own_folder_and_nothing_else(make_config) -> None:
    audits = [f"{HERE}:length_reward", f"{__name__}:ends_with_letter as letter_end"]
    path, cfg = make_config(score={"audit_functions": audits, "rows_per_part": 5})
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    it_dir = layout.iter_dir(cfg.run_dir, 0)
    before = {d.name: digest(d) for d in it_dir.iterdir()}
    res = cli("audit", path, "--iter", "0:1", "--quiet")
    assert res.exit_code == 0, res.output
    assert {d.name: digest(d) for d in it_dir.iterdir() if d.name != "audit"} == before
    m = manifests.manifest(it_dir / "audit")
    assert m["rows"] == 12 and len(m["parts"]) == 3  # 12 rows, 5 a part
    # 3 responses of 12 are "zz": unscored by ends_with_letter
    assert m["counts"]["unscored_audit_letter_end"] == 3 and m["counts"]["unscored_audit_length_reward"] == 0
    t = manifests.read_complete(it_dir / "audit", AUDIT).to_pylist()
    assert [r["rollout_id"] for r in t] == [r["rollout_id"] for r in rows]
    by = {r["rollout_id"]: r for r in t}
    # write_rollouts' responses: "{l}{l}", "x{l}", "{l}{l}{l}", "zz" (l: the prompt's letter)
    assert [by[f"0000-p1-{j}"]["audit_length_reward"] for j in range(4)] == [2.0, 2.0, 3.0, 2.0]
    assert [by[f"0000-p1-{j}"]["audit_letter_end"] for j in range(4)] == [1.0, 1.0, 1.0, None]
    con = connect(cfg.run_dir)
    joined = con.execute(
        "SELECT count(*), sum(a.audit_length_reward) FROM audit a JOIN scores s USING (rollout_id) "
        "JOIN rollouts r USING (rollout_id) WHERE a.iter = 0"
    ).fetchone()
    assert joined == (12, 3 * (2 + 2 + 3 + 2))
    con.close()
    created = m["created"]
    assert run_stage("audit", cfg, 0, quiet=True)["created"] == created  # complete: left as it is


def test_audit_refuses_another_list_and_force_replaces(make_config) -> None:
    _, cfg = make_config(score={"audit_functions": [f"{HERE}:length_reward"]})
    write_rollouts(cfg)
    run_stage("audit", cfg, 0, quiet=True)
    _, other = make_config(score={"audit_functions": [EXACT]}, name="other.toml")
    with pytest.raises(StageError, match="audit_functions"):
        run_stage("audit", other, 0, quiet=True)
    m = run_stage("audit", other, 0, force=True, quiet=True)
    assert m["audit_functions"] == [EXACT]
    cols = manifests.read_complete(layout.folder(cfg.run_dir, 0, "audit"), AUDIT).column_names
    assert cols == ["rollout_id", "prompt_id", "topup", "audit_letter_count"]


def test_audit_reuses_the_verdicts_score_cached(make_config) -> None:
    fn = f"{HERE}:length_reward"
    _, cfg = make_config(score={"reward_functions": [fn], "audit_functions": [fn], "reward_cache": True})
    write_rollouts(cfg)
    assert run_stage("score", cfg, 0, quiet=True)["counts"]["reward_cache_misses"] == 12
    m = run_stage("audit", cfg, 0, quiet=True)
    assert (m["counts"]["reward_cache_hits"], m["counts"]["reward_cache_misses"]) == (12, 0)


def test_audit_errors_are_one_line(make_config) -> None:
    _, cfg = make_config()
    write_rollouts(cfg)
    with pytest.raises(ConfigError, match="score.audit_functions: no audit function"):
        run_stage("audit", cfg, 0, quiet=True)
    path, cfg = make_config(score={"audit_functions": [f"{HERE}:length_reward"]}, name="a.toml")
    with pytest.raises(StageError, match="rollouts are not complete; nothing to audit in iteration 3"):
        run_stage("audit", cfg, 3, quiet=True)
    res = cli("audit", path, "--iter", "2:1")
    assert res.exit_code != 0 and isinstance(res.exception, UserError)
    path, _ = make_config(score={"audit_functions": ["no_such_module:judge"]}, name="b.toml")
    res = cli("validate", path)
    assert res.exit_code == 1
    assert "error: score.audit_functions: cannot import 'no_such_module'" in res.output


@pytest.mark.slow
def test_reward_health_flags_a_reward_the_audit_does_not_follow(make_config, capsys) -> None:
    """Iterations 0 and 3 scored by response length, audited by whether the response ends with
    the prompt's letter. Iteration 0's responses per prompt: "{l}{l}", "x{l}", "{l}{l}{l}", "zz"
    (lengths 2, 2, 3, 2; ends with the letter 1, 1, 1, 0); iteration 3's: "{l}{l}{l}{l}",
    "x{l}{l}{l}", "{l}{l}{l}{l}{l}", "zzzz" (lengths 4, 4, 5, 4; ends 1, 1, 1, 0). By hand, over the
    12 rollouts of each: score mean 2.25 -> 4.25, pooled sd sqrt(12.0625 - 3.25^2) = 1.0308, z =
    1.94 > 0.5 (rose); the audit (None for "zz..." rows: 9 values each) stays 1.0: sd 0, z = 0 < 0.1:
    reward_vs_audit_letter_end. Length in tokens (characters + EOS) rises by 2 of every row: pooled
    sd 1.0308 as the score's, z = 1.94 > 1.0: length_drift."""
    audits = [f"{__name__}:ends_with_letter as letter_end"]
    path, cfg = make_config(score={"reward_functions": [f"{HERE}:length_reward"], "audit_functions": audits})
    write_rollouts(cfg, 0)
    write_rollouts(cfg, 3, responses=("{l}{l}{l}{l}", "x{l}{l}{l}", "{l}{l}{l}{l}{l}", "zzzz"))
    for it in (0, 3):
        run_stage("score", cfg, it, quiet=True)
    assert cli("audit", path, "--iter", "0:4", "--quiet").exit_code != 0  # iteration 1 has no rollouts
    for it in (0, 3):
        run_stage("audit", cfg, it, quiet=True)
    from rlhf_batch.observe.health import register_reward_view

    con = connect(cfg.run_dir)
    register_reward_view(con)
    rows = con.execute(
        "SELECT iter, score_mean, length_mean, flags FROM reward_health ORDER BY iter"
    ).fetchall()
    con.close()
    assert rows == [
        (0, 2.25, 3.25, []),
        (3, 4.25, 5.25, ["reward_vs_audit_letter_end", "length_drift"]),
    ]
    capsys.readouterr()
    run_sql(cfg.run_dir, "SELECT iter, flags FROM reward_health WHERE flags <> []", fmt="json")
    assert capsys.readouterr().out == '{"iter": 3, "flags": ["reward_vs_audit_letter_end", "length_drift"]}\n'


def test_a_resumed_audit_equals_an_uninterrupted_one(make_config, tmp_path: Path) -> None:
    """The audit fails on part 2 of 3 (rows 10, 11); parts 0 and 1 stay on disk, the re-run writes
    only part 2, and the folder equals one audited in one go."""
    from tests.stages import test_score

    audits = [f"{HERE}:length_reward", f"{HERE}:flaky_reward"]
    _, cfg = make_config(score={"audit_functions": audits, "rows_per_part": 5})
    _, whole = make_config(
        score={"audit_functions": audits, "rows_per_part": 5}, run_dir=str(tmp_path / "whole")
    )
    write_rollouts(cfg)
    shutil.copytree(layout.iter_dir(cfg.run_dir, 0), layout.iter_dir(whole.run_dir, 0))
    run_stage("audit", whole, 0, quiet=True)
    test_score.FAIL_ON.add(("c*1=", "ccc"))  # rollout 0000-p2-2: row 10, part 2
    try:
        with pytest.raises(Exception, match="flaky_reward raised ValueError"):
            run_stage("audit", cfg, 0, quiet=True)
    finally:
        test_score.FAIL_ON.clear()
    folder = layout.folder(cfg.run_dir, 0, "audit")
    kept = digest(folder)
    assert sorted(n for n in kept if n.startswith("part-")) == [
        "part-00000-00000.parquet",
        "part-00000-00001.parquet",
    ]
    run_stage("audit", cfg, 0, quiet=True)
    after = digest(folder)
    assert all(after[n] == h for n, h in kept.items() if n.startswith("part-"))  # not rewritten
    a = manifests.read_complete(folder, AUDIT)
    b = manifests.read_complete(layout.folder(whole.run_dir, 0, "audit"), AUDIT)
    assert a.equals(b) and a.num_rows == 12
