"""`--force` of a fanned-out rank redoes its own parts: a retried array task with a changed config
(or a bad part) is not stuck. The other ranks' parts stay; a part that another identity wrote is
never committed: the stage waits for its rank to be forced too."""

from __future__ import annotations

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS
from tests.stages.cli_helpers import cli, manifest


def rank(config, r: int, *extra: str) -> object:  # noqa: ANN001
    res = cli("generate", config, "--quiet", "--rank", r, "--world-size", 2, *extra)
    assert res.exit_code == 0, (res.output, res.exception)  # type: ignore[attr-defined]
    return res


def test_each_forced_rank_redoes_its_parts_and_the_last_commits(make_config) -> None:
    path, cfg = make_config(threads=1)
    rank(path, 0)
    rank(path, 1)
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    old = manifests.read_complete(sdir, ROLLOUTS)
    # a changed config: each rank of the resubmitted fan-out is forced
    rank(path, 1, "--set", "generate.temperature=0.5", "--force")
    assert manifests.manifest(sdir) is None  # rank 0's parts are of the old config: no commit
    # 12 prompts in parts of 5: parts 0, 1, 2; rank 1 redid part 1, parts 0 and 2 are rank 0's old ones
    assert sorted(p.name for p in layout.list_parts(sdir)) == sorted(
        [layout.part_name(0, 0), layout.part_name(1, 1), layout.part_name(0, 2)]
    )
    rank(path, 0, "--set", "generate.temperature=0.5", "--force")
    m = manifest(cfg.run_dir, "rollouts")
    assert m["rows"] == 48 and m["config"]["generate"]["temperature"] == 0.5
    new = manifests.read_complete(sdir, ROLLOUTS)
    # every part written by the new config's runs (the identity each records), none of the old
    assert {manifests.footer_identity(sdir / p["file"])[2] for p in m["parts"]} == {manifests.located_key(m)}
    assert new["rollout_id"].to_pylist() == old["rollout_id"].to_pylist()
    assert new["behavior_logprobs"].to_pylist() != old["behavior_logprobs"].to_pylist()  # temperature 0.5


def test_a_rank_not_forced_leaves_an_old_part_uncommitted_and_says_so(make_config) -> None:
    path, cfg = make_config(threads=1)
    rank(path, 0)
    rank(path, 1)
    rank(path, 0, "--set", "generate.temperature=0.5", "--force")
    res = rank(path, 1, "--set", "generate.temperature=0.5")  # forgot --force: its old part stays
    assert (
        "written with another config or inputs (by a rank of an earlier run): run its rank with --force"
        in res.output
    )  # type: ignore[attr-defined]
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)) is None
    rank(path, 1, "--set", "generate.temperature=0.5", "--force")
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48


def test_a_forced_rank_of_the_same_config_redoes_only_its_parts(make_config) -> None:
    path, cfg = make_config(threads=1)
    rank(path, 0)
    rank(path, 1)
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    before = {p.name: p.stat().st_mtime_ns for p in layout.list_parts(sdir)}
    rank(path, 1, "--force")  # a retried task: its part again, and the commit
    after = {p.name: p.stat().st_mtime_ns for p in layout.list_parts(sdir)}
    assert after.keys() == before.keys()
    changed = {n for n in after if after[n] != before[n]}
    assert changed == {layout.part_name(1, 1)}
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
