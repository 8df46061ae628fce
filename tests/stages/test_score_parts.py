"""Score's parts fanned out: sized from the world size, so that every rank has rows to score, and
agreed on by every later process whatever its world size."""

from __future__ import annotations

from rlhf_batch.stages.executor import is_done
from rlhf_batch.stages.registry import get
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES
from tests.stages.cli_helpers import cli, manifest, stage


def score_rank(config, rank: int, world: int) -> None:  # noqa: ANN001
    res = cli("score", config, "--quiet", "--rank", rank, "--world-size", world)
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]


def test_two_ranks_share_the_default_part_size_and_a_single_process_agrees(make_config) -> None:
    path, cfg = make_config(threads=1)  # score.rows_per_part: the default, 2048
    stage(path, "generate")  # 12 prompts x 4 = 48 rollouts
    score_rank(path, 1, 2)
    sdir = layout.folder(cfg.run_dir, 0, layout.SCORES)
    # min(2048, ceil(48 / 2)) = 24 rows a part: rank 1 scores rows 24..47 (part 1), not nothing
    (part,) = layout.list_parts(sdir)
    assert part.name == layout.part_name(1, 1) and manifests.read_table(part).num_rows == 24
    score_rank(path, 0, 2)
    m = manifest(cfg.run_dir, "scores")
    assert [(p["file"], p["rows"]) for p in m["parts"]] == [
        (layout.part_name(0, 0), 24),
        (layout.part_name(1, 1), 24),
    ]
    assert m["inputs"]["part_rows"] == 24
    # a single process (a plain `score`, `run`) finds the stage complete, with its parts
    before = (sdir / layout.MANIFEST).read_text()
    stage(path, "score")
    assert is_done(get("score")(cfg, 0))  # what `run` asks before it skips the stage
    assert (sdir / layout.MANIFEST).read_text() == before
    assert manifests.read_complete(sdir, SCORES).num_rows == 48


def test_a_single_process_resumes_a_fanned_out_score_with_its_part_size(make_config) -> None:
    path, cfg = make_config(threads=1, score={"rows_per_part": 30})
    stage(path, "generate")
    score_rank(path, 0, 3)  # min(30, ceil(48 / 3)) = 16: parts 0, 1, 2; rank 0 writes part 0
    stage(path, "score")  # world 1 takes the folder's 16 (not 30) and writes parts 1 and 2
    m = manifest(cfg.run_dir, "scores")
    assert [p["rows"] for p in m["parts"]] == [16, 16, 16] and m["inputs"]["part_rows"] == 16


def test_parts_are_unchanged_when_every_rank_already_has_one(make_config) -> None:
    path, cfg = make_config(threads=1, score={"rows_per_part": 10})
    stage(path, "generate")
    for rank in (0, 1):
        score_rank(path, rank, 2)  # min(10, 24) = 10: 5 parts, as a single process writes them
    m = manifest(cfg.run_dir, "scores")
    assert [p["rows"] for p in m["parts"]] == [10, 10, 10, 10, 8] and "part_rows" not in m["inputs"]
