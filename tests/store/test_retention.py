"""keep_policies / keep_every: which policies are kept, and that removal waits for the next policy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhf_batch.store import layout, output, retention
from rlhf_batch.store.modeldir import model_fingerprint


def test_kept_is_the_last_n_plus_every_mth() -> None:
    # train 9 complete, N = 2, M = 4: the last two (8, 9) and 0, 4, 8
    assert [it for it in range(10) if retention.kept(it, 9, 2, 4)] == [0, 4, 8, 9]
    assert [it for it in range(10) if retention.kept(it, 9, 1, 0)] == [9]
    assert all(retention.kept(it, 9, 0, 0) for it in range(10))  # 0: keep everything


def fake_policy(run_dir: Path, it: int, train_done: bool) -> Path:
    """A policy dir (config.json + safetensors, all model_fingerprint reads) and, when
    `train_done`, a complete train folder of that iteration."""
    pol = layout.policy_dir(run_dir, it)
    pol.mkdir(parents=True)
    (pol / "config.json").write_text(json.dumps({"iteration": it}))
    save_file({"w": torch.full((it + 1,), float(it))}, str(pol / "model.safetensors"))
    if train_done:
        out = output.claim(layout.folder(run_dir, it, layout.TRAIN), "train", {"it": it}, {})
        out.finish(0)
    return pol


def test_prune_waits_for_the_next_policy_and_keeps_the_fingerprint(make_config, tmp_path: Path) -> None:
    _, cfg = make_config(keep_policies=1, run_dir=str(tmp_path / "run"))
    run = Path(cfg.run_dir)
    before = {it: model_fingerprint(str(fake_policy(run, it, it != 2)), "policy") for it in range(4)}
    # trains 0, 1 and 3 complete, 2 not: policy 1 stays (the policy after it, 2, is not complete);
    # 0 and 2 go (policies 1 and 3 after them are complete); 3 is the last one
    assert retention.prune(cfg, 3) == [0, 2]
    assert [it for it in range(4) if layout.policy_dir(run, it).is_dir()] == [1, 3]
    assert model_fingerprint(str(layout.policy_dir(run, 0)), "policy") == before[0]  # recorded
    record = json.loads((layout.iter_dir(run, 0) / layout.POLICY_REMOVED).read_text())
    # stored with the run directory as "{run_dir}" (a run can be moved), read back where it is now
    assert record["keep_policies"] == 1 and record["fingerprint"] == layout.portable(
        before[0], run.absolute()
    )
    assert record["fingerprint"]["path"] == "{run_dir}/iter=0000/policy"
    assert retention.prune(cfg, 3) == []  # nothing more to do
    (layout.iter_dir(run, 1) / f"{layout.POLICY_TRASH}123").mkdir()  # a removal killed half-way
    _, off = make_config(run_dir=str(run))
    assert retention.prune(off, 3) == []  # keep_policies 0: nothing is removed
    assert retention.prune(cfg, 3) == []
    assert not list(layout.iter_dir(run, 1).glob(".policy*"))  # the leftover went


def test_prune_on_a_store_deletes_the_policy_objects_and_keeps_the_fingerprint(
    make_config, s3_server, tmp_path: Path, monkeypatch
) -> None:
    from rlhf_batch.store import fs
    from tests.s3server import new_bucket

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    _, cfg = make_config(keep_policies=1, run_dir=f"s3://{new_bucket(s3_server)}/run")
    run, local = fs.run_path(cfg.run_dir), tmp_path / "local"
    for it in range(2):  # policies 0 and 1 on the store, both trains complete
        fake_policy(local, it, False)
        fs.put_dir(layout.policy_dir(local, it), layout.policy_dir(run, it))
        output.claim(layout.folder(run, it, layout.TRAIN), "train", {"it": it}, {}).finish(0)
    before = model_fingerprint(str(layout.policy_dir(run, 0)), "policy")
    assert retention.prune(cfg, 1) == [0]
    assert not layout.policy_dir(run, 0).exists() and layout.policy_dir(run, 1).is_dir()
    assert model_fingerprint(str(layout.policy_dir(run, 0)), "policy") == before  # recorded
    assert not list(layout.iter_dir(run, 0).glob(".policy*"))  # nothing left under a hidden name
