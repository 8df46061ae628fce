"""Models given as hub ids resolve through a Hugging Face cache laid out here, offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlhf_batch.config import load_config
from rlhf_batch.errors import ModelError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests

REVISION = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(home: Path, repo: str, model: Path) -> Path:
    """HF_HOME/hub/models--org--name/{refs/main, snapshots/<commit>/...}, as huggingface_hub
    leaves it after a download."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / REVISION
    shutil.copytree(model, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REVISION)
    return snap


@pytest.fixture
def offline_cache(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    snap = lay_out_cache(home, "tiny-org/tiny-policy", tiny_model)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_hub_id_resolves_to_the_cache_and_its_revision_is_in_the_manifest(
    make_config, offline_cache: Path
) -> None:
    _, cfg = make_config(policy_model="tiny-org/tiny-policy", generate={"num_generations": 1})
    assert Path(cfg.policy_model) == offline_cache
    m = run_stage("generate", cfg, 0, quiet=True)
    assert m["rows"] == 12
    hub = manifests.manifest(layout.folder(cfg.run_dir, 0, "rollouts"))["inputs"]["policy"]["hub"]
    assert hub == {"id": "tiny-org/tiny-policy", "revision": REVISION}
    # a revision given after @ resolves to that snapshot
    _, cfg = make_config(name="r.toml", policy_model=f"tiny-org/tiny-policy@{REVISION}")
    assert Path(cfg.policy_model) == offline_cache
    # --set takes hub ids too (not made into a path under the current directory)
    cfg = load_config(None, ["policy_model=tiny-org/tiny-policy"])
    assert Path(cfg.policy_model) == offline_cache


def test_an_id_not_in_the_cache_while_offline_says_how_to_fetch_it(make_config, offline_cache: Path) -> None:
    with pytest.raises(ModelError) as e:
        make_config(policy_model="Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "policy_model: 'Qwen/Qwen2.5-0.5B-Instruct' is not a local directory and not in the"
    )
    assert str(offline_cache.parents[2]) in msg  # the cache it looked in (HF_HOME/hub)
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in msg and "HF_HUB_OFFLINE" in msg


def test_an_existing_local_directory_wins_over_a_hub_id(
    tmp_path: Path, tiny_model: Path, offline_cache: Path
) -> None:
    local = tmp_path / "tiny-org" / "tiny-policy"
    shutil.copytree(tiny_model, local)
    conf = tmp_path / "c.toml"
    conf.write_text('policy_model = "tiny-org/tiny-policy"\n')
    assert Path(load_config(conf).policy_model) == local
