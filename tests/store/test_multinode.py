"""Two "machines" under torchrun multi-node: two separate torchrun launchers (node 0 and node 1,
one process each, c10d rendezvous on 127.0.0.1), each with its own working directory and model
cache, sharing only the run on a real S3-protocol server (moto, on 127.0.0.1). They run generate,
score and train of iteration 0 and generate of iteration 1 (which loads iteration 0's policy from
the store through each node's cache), and give the rows and weights of one process on local disk.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.fs import arrow_source, run_path
from rlhf_batch.store.schemas import ROLLOUTS, SCORES
from tests.s3server import free_port
from tests.stages.cli_helpers import stage
from tests.stages.test_train import max_diff
from tests.store.test_fanout import machine

REPO = Path(__file__).parents[2]
# as tests/stages/test_train_dist.py: a small lr, so that float noise in near-zero gradient
# elements (2 ranks sum them in another order) stays of order 1e-7 in the weights
TRAIN = dict(
    lr=1e-4, tokens_per_step=96, max_tokens_per_batch=40, ppo_epochs=2, kl_loss_coef=0.1, checkpoint_every=2
)


def torchrun_nodes(nodes: list[tuple[Path, dict]], cmd: str, config: Path, it: int) -> None:
    """`cmd` of iteration `it` on two nodes: two torchrun launchers meeting at one c10d rendezvous."""
    rdzv = [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        f"{cmd}-{it}",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv]
    argv = [*launch, "-m", "rlhf_batch", cmd, str(config), "--iter", str(it), "--quiet"]
    procs = [
        subprocess.Popen(
            argv,
            cwd=home,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for home, env in nodes
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]


def rows(run_dir: str, it: int, stage: str, schema: pa.Schema) -> list[dict]:
    """Every column but the path of the policy that sampled (a store URI vs a local path)."""
    table = manifests.read_complete(layout.folder(run_dir, it, stage), schema).sort_by("rollout_id")
    return table.drop_columns([c for c in ["policy"] if c in table.column_names]).to_pylist()


def metrics(run_dir: str) -> list[dict]:
    import pyarrow.parquet as pq

    path, filesystem = arrow_source(layout.folder(run_dir, 0, "train") / layout.METRICS_FILE)
    return pq.read_table(path, filesystem=filesystem).to_pylist()


def policy(run_dir: str, it: int) -> dict[str, torch.Tensor]:
    return load((run_path(run_dir) / f"iter={it:04d}" / "policy" / "model.safetensors").read_bytes())


def cached(home: Path) -> set[str]:
    """The store directories a node copied into its model cache (each copy names its source)."""
    return {p.read_text() for p in (home / "cache" / "models").glob("*/.complete")}


@pytest.mark.slow
def test_two_nodes_under_torchrun_share_an_s3_run_and_give_the_rows_of_one_process(
    make_config, s3_run: str, s3_server, tiny_model: Path, tmp_path: Path
) -> None:
    # the base policy on the store too: each node copies it into its own cache
    base = run_path(s3_run).parent / "models" / "policy"
    base.fs.put(str(tiny_model), base.path, recursive=True)  # type: ignore[attr-defined]
    keys = dict(threads=1, train=TRAIN, score={"rows_per_part": 10})
    local, local_cfg = make_config(name="local.toml", **keys)
    remote, cfg = make_config(name="s3.toml", run_dir=s3_run, policy_model=str(base), **keys)
    nodes = [machine(tmp_path, f"node{r}", s3_server.env()) for r in range(2)]

    torchrun_nodes(nodes, "generate", remote, 0)
    torchrun_nodes(nodes, "score", remote, 0)
    subprocess.run(  # advantage: one CPU process, on node 0
        [sys.executable, "-m", "rlhf_batch", "advantage", str(remote), "--iter", "0", "--quiet"],
        cwd=nodes[0][0],
        env={**nodes[0][1], "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
    )
    torchrun_nodes(nodes, "train", remote, 0)
    torchrun_nodes(nodes, "generate", remote, 1)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): the same float sums
    try:
        for name, it in (("generate", 0), ("score", 0), ("advantage", 0), ("train", 0), ("generate", 1)):
            stage(local, name, it=it)
    finally:
        torch.set_num_threads(threads)

    for stage_name, schema in (("rollouts", ROLLOUTS), ("scores", SCORES)):
        m = manifests.manifest(layout.folder(cfg.run_dir, 0, stage_name))
        assert m is not None
        assert {p["file"][5:10] for p in m["parts"]} == {"00000", "00001"}  # both nodes wrote parts
        a, b = rows(cfg.run_dir, 0, stage_name, schema), rows(local_cfg.run_dir, 0, stage_name, schema)
        assert len(a) == 48 and a == b, stage_name  # every column, floats bit for bit
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "train"))["world_size"] == 2
    for a, b in zip(metrics(cfg.run_dir), metrics(local_cfg.run_dir), strict=True):
        assert (a["tokens"], a["sequences"]) == (b["tokens"], b["sequences"])
        for k in ("loss", "ratio_mean", "clip_fraction", "kl_to_ref", "entropy", "ess"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    w_two, w_one = policy(cfg.run_dir, 0), policy(local_cfg.run_dir, 0)
    assert (
        max_diff(w_two, w_one)
        < 1e-5
        < 1e-4
        < max_diff(w_one, load(Path(tiny_model, "model.safetensors").read_bytes()))
    )
    # iteration 1 samples from the trained policy (weights equal to 1e-5: the same tokens)
    a, b = rows(cfg.run_dir, 1, "rollouts", ROLLOUTS), rows(local_cfg.run_dir, 1, "rollouts", ROLLOUTS)
    assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b] and len(a) == 48
    for ra, rb in zip(a, b, strict=True):
        assert ra["behavior_logprobs"] == pytest.approx(rb["behavior_logprobs"], abs=1e-4)
    # nothing of the run on a node's disk: only its cache of models (never a folder named s3:)
    for home, _ in nodes:
        assert [p.name for p in home.iterdir()] == ["cache"]
    # each node copied the base policy and iteration 0's policy into its own cache
    for home, _ in nodes:
        assert {str(base), str(layout.policy_dir(cfg.run_dir, 0))} <= cached(home)
