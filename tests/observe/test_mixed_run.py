"""Every view, `status` and `report` on a run holding every kind of rollout (single-turn,
generated multi-turn, imported messages, imported prompt/response, replayed rows), and what
each stage of that run read from the one before (tests/fixtures/mixed_run.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.observe.health import REWARD_VIEW
from rlhf_batch.observe.query import VIEWS, connect, run_sql
from rlhf_batch.observe.report import write_report
from rlhf_batch.observe.status import print_status
from rlhf_batch.store import layout, manifests
from tests.fixtures.mixed_run import KINDS, ROUNDS

ALL_VIEWS = [*VIEWS, "stages", "eval_metrics", "health", REWARD_VIEW, "prompt_stats", "source_stats", "turns"]
ROWS = {0: 8, 1: 8, 2: 4, 3: 4}  # rollouts per iteration: 4 prompts x 2, 4 messages, 4 pairs


def rows(root: Path, it: int, folder: str) -> dict[str, dict]:
    """rollout_id -> row, straight from the Parquet parts of a complete folder of iteration
    `it` (rollouts and scores: and of its top-up rounds)."""
    out = {}
    for r in ROUNDS[it] if folder in ("rollouts", "scores") else [0]:
        sdir = layout.folder(root, it, folder, r)
        m = manifests.manifest(sdir)
        assert m is not None, sdir
        out |= {x["rollout_id"]: x for p in m["parts"] for x in pq.read_table(sdir / p["file"]).to_pylist()}
    return out


def byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable stand-in of each byte -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    more = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(more)}


def chars(tok, ids: list[int]) -> str:  # noqa: ANN001
    """The text of `ids` in the tiny char-level tokenizer, worked out token by token: a special
    token is its name, any other one byte of the byte-level alphabet."""
    table, out = byte_of(), b""
    for t in tok.convert_ids_to_tokens(ids):
        out += t.encode() if t.startswith("<|") else bytes([table[t]])
    return out.decode()


def part_of(mixed_run, iterations: list[int], tmp_path: Path) -> Path:
    """A run holding only these iterations of the mixed run (a copy)."""
    if iterations == list(KINDS):
        return mixed_run.root
    root = tmp_path / "run"
    for it in iterations:
        shutil.copytree(layout.iter_dir(mixed_run.root, it), layout.iter_dir(root, it))
    return root


@pytest.mark.parametrize(
    "iterations",
    [list(KINDS), [2], [0, 2, 3], [2, 3]],
    ids=["all", "messages", "no-generated-turns", "imported"],
)
def test_every_view_status_and_report_answer(mixed_run, iterations, tmp_path, capsys) -> None:
    """Imported messages have turn columns but none of the environment's (`turns`, `env_error`):
    a run without generated multi-turn rows could not be read at all before."""
    root = part_of(mixed_run, iterations, tmp_path)
    for view in ALL_VIEWS:
        run_sql(root, f"SELECT count(*) AS n FROM {view}", fmt="json")
        assert json.loads(capsys.readouterr().out)["n"] >= 0, view
    run_sql(root, "SELECT iter, count(*) AS n FROM rollouts GROUP BY iter ORDER BY iter", fmt="json")
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert got == [{"iter": it, "n": ROWS[it]} for it in iterations]
    run_sql(root, "SELECT iter, topup, count(*) AS n FROM scores GROUP BY ALL ORDER BY ALL", fmt="json")
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rounds = [(it, r) for it in iterations for r in ROUNDS[it]]
    assert [(g["iter"], g["topup"]) for g in got] == rounds  # iteration 0's top-up round too
    print_status(root)
    table = capsys.readouterr().out
    # a copied iteration's train is stale when the iteration before it is not in the copy
    states = ("complete",) if root == mixed_run.root else ("complete", "stale")
    for it in iterations:
        for stage in ("rollouts", "scores", "advantages", "train"):
            assert any(
                line.split()[:2] == [str(it), stage] and line.split()[2] in states
                for line in table.splitlines()
            ), table
    assert (write_report(root, tmp_path / "report")).is_file()


def test_turns_view_gives_each_segments_text_and_offsets(mixed_run) -> None:
    tok = load_tokenizer(mixed_run.cfg(0).policy_model)
    con = connect(mixed_run.root)
    got = con.sql("SELECT * FROM turns ORDER BY iter, rollout_id, segment").to_arrow_table().to_pylist()
    con.close()
    by_rollout: dict[str, list[dict]] = {}
    for r in got:
        by_rollout.setdefault(r["rollout_id"], []).append(r)
    expected = {}
    for it in (1, 2):
        expected |= rows(mixed_run.root, it, "rollouts")
    assert set(by_rollout) == set(expected)  # every multi-turn rollout, no other
    imported = [[s["role"] for s in by_rollout[rid]] for rid in sorted(rows(mixed_run.root, 2, "rollouts"))]
    assert sorted(imported) == sorted(
        [
            ["assistant", "tool", "assistant"],
            ["assistant"],
            ["assistant"],
            ["assistant", "tool", "user", "assistant"],
        ]
    )
    for rid, segments in by_rollout.items():
        r = expected[rid]
        ids = r["response_ids"]
        for k, s in enumerate(segments):
            assert (s["segment"], s["role"], s["start"]) == (k, r["turn_roles"][k], r["turn_starts"][k])
            piece = ids[s["start"] : s["start"] + s["tokens"]]
            assert s["text"] == chars(tok, piece)
            assert s["sampled"] == (s["role"] == "assistant")
            assert s["turns"] == r["turn_roles"].count("assistant")
            last = k == len(segments) - 1
            assert s["env_error"] == (r.get("env_error") if last else None)
        assert sum(s["tokens"] for s in segments) == len(ids)


def test_each_stage_reads_what_the_one_before_wrote(mixed_run) -> None:
    """advantage: the reward score wrote, the tokens and loss mask generate or import wrote, for
    every kind; replayed rows as their source iteration stored them. train: the sampled tokens
    of each row (its loss mask's ones) are the ones it trained on."""
    root = mixed_run.root
    stored = {it: rows(root, it, "advantages") for it in KINDS}
    for it, kind in KINDS.items():
        rollouts = rows(root, it, "rollouts")
        scores = rows(root, it, "scores")
        adv = stored[it]
        own = {rid: a for rid, a in adv.items() if rid in rollouts}
        assert len(own) == ROWS[it], kind
        for rid, a in own.items():
            r = rollouts[rid]
            assert a["reward"] == scores[rid]["reward"], kind
            assert a["input_ids"] == r["prompt_ids"] + r["response_ids"], kind
            assert a["prompt_len"] == len(r["prompt_ids"]), kind
            assert a["behavior_logprobs"] == r["behavior_logprobs"], kind
            assert a.get("loss_mask") == r.get("loss_mask"), kind  # None: single-turn, all ones
        has_mask = {rid: r.get("loss_mask") is not None for rid, r in rollouts.items()}
        assert all(has_mask.values()) == (kind in ("multi-turn", "messages")), kind
        replayed = manifests.manifest(layout.folder(root, it, "advantages")).get("replay")
        sources = replayed["from"] if replayed else {}
        assert (it > 0) == bool(sources), kind
        for j, src in sources.items():
            for rid in src["rollout_ids"]:
                a, before = adv[rid], stored[int(j)][rid]
                assert {k: v for k, v in a.items() if k != "loss_mask"} == {
                    k: v for k, v in before.items() if k != "loss_mask"
                }
                assert a.get("loss_mask") == before.get("loss_mask")
        trained = pq.read_table(layout.folder(root, it, "train") / layout.ROLLOUT_STATS_FILE).to_pylist()
        # the rows of advantage 0 add nothing and are skipped (iteration 0's rewards are all 0)
        active = {rid for rid, a in adv.items() if a["advantage"] != 0}
        assert {t["rollout_id"] for t in trained} == active and (bool(active) or it == 0), kind
        for t in trained:
            a = adv[t["rollout_id"]]
            mask = a.get("loss_mask") or [1] * (len(a["input_ids"]) - a["prompt_len"])
            assert t["tokens"] == sum(mask), (kind, t["rollout_id"])
