import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rlhf_batch.errors import StageError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.models.tiny import init_model
from rlhf_batch.runtime import faults
from rlhf_batch.stages import executor, generate
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ROLLOUTS


def rollouts(cfg, it: int = 0) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "rollouts"), ROLLOUTS)


def test_rollouts_table_ids_and_carried_columns(make_config) -> None:
    _, cfg = make_config()
    m = run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg)
    assert m["rows"] == t.num_rows == 12 * 4  # 12 demo prompts x G=4
    assert len(m["parts"]) == 3  # ceil(12 prompts / 5 per part)
    assert t.column("rollout_id").to_pylist()[:2] == ["0000-demo-000000-0", "0000-demo-000000-1"]
    assert len(set(t.column("rollout_id").to_pylist())) == t.num_rows
    assert {"letter", "count"} <= set(t.column_names)  # carried along for reward functions
    for row in t.to_pylist():
        assert len(row["behavior_logprobs"]) == len(row["response_ids"]) <= 6
        assert row["finish_reason"] in ("stop", "length")
        assert (row["finish_reason"] == "length") == (
            len(row["response_ids"]) == 6
            and row["response_ids"][-1] not in (0, 4)  # <|endoftext|>, <|im_end|>
        )
        assert row["policy"] == cfg.policy_model


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 0.8)])
def test_behaviour_logprobs_match_a_plain_forward_pass(
    make_config, temperature: float, top_k: int, top_p: float
) -> None:
    """Stored log-probs are those of logits/temperature over the whole vocabulary, before top-k and
    top-p filtering: the same definition score and train use."""
    _, cfg = make_config(generate={"temperature": temperature, "top_k": top_k, "top_p": top_p})
    run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg).to_pylist()
    model = load_model(cfg.policy_model, "policy", dtype="float32")
    with torch.no_grad():
        logp, mask, _ = response_logprobs(
            model,
            [r["prompt_ids"] + r["response_ids"] for r in t],
            [len(r["prompt_ids"]) for r in t],
            cfg.generate.temperature,
            pad_id=1,
        )
    stored = torch.zeros_like(logp)
    for i, r in enumerate(t):
        stored[i, : len(r["behavior_logprobs"])] = torch.tensor(r["behavior_logprobs"])
    assert mask.sum() == sum(len(r["response_ids"]) for r in t)
    assert (logp - stored)[mask].abs().max() < 1e-5
    if top_k:  # each sampled token is among the k most likely, so filtering did act on the draws
        with torch.no_grad():
            for r in t:
                ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
                start = len(r["prompt_ids"]) - 1  # logits[start + j] predict response token j
                logits = model(ids).logits[0, start:-1]  # [T, V]
                rank = (logits > logits.gather(1, torch.tensor(r["response_ids"])[:, None])).sum(1)
                assert int(rank.max()) < top_k


def test_same_config_and_seed_give_identical_files_whatever_the_batch_size(
    make_config, tmp_path: Path
) -> None:
    _, a = make_config(run_dir=str(tmp_path / "a"))
    _, b = make_config(run_dir=str(tmp_path / "b"), name="b.toml", generate={"batch_size": 3})
    _, c = make_config(run_dir=str(tmp_path / "c"), name="c.toml")
    for cfg in (a, b, c):
        run_stage("generate", cfg, 0, quiet=True)
    ids = [rollouts(cfg).column("response_ids").to_pylist() for cfg in (a, b, c)]
    assert ids[0] == ids[1] == ids[2]
    part = layout.part_name(0, 0)
    assert (Path(a.run_dir) / "iter=0000/rollouts" / part).read_bytes() == (
        Path(c.run_dir) / "iter=0000/rollouts" / part
    ).read_bytes()
    _, d = make_config(run_dir=str(tmp_path / "d"), name="d.toml", seed=1)
    run_stage("generate", d, 0, quiet=True)
    assert rollouts(d).column("response_ids").to_pylist() != ids[0]  # the seed matters


def test_pad_equal_to_eos_keeps_the_eos_token_and_its_logprob(make_config, tmp_path: Path) -> None:
    path = init_model(tmp_path / "eos_model", pad="eos", seed=3)
    model = load_model(str(path), "policy", dtype="float32")
    with torch.no_grad():  # make EOS (id 0) likely so that some responses stop early
        model.get_output_embeddings().weight[0] *= 30
    model.save_pretrained(path)
    _, cfg = make_config(policy_model=str(path))
    run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg).to_pylist()
    assert all(r["response_ids"][-1] in (0, 4) for r in t if r["finish_reason"] == "stop")  # EOS, <|im_end|>
    stopped = [r for r in t if r["finish_reason"] == "stop" and r["response_ids"][-1] == 0]
    assert stopped, "the EOS-biased model should stop some responses"
    for r in stopped:
        assert len(r["behavior_logprobs"]) == len(r["response_ids"])
    with torch.no_grad():
        logp, mask, _ = response_logprobs(
            model,
            [r["prompt_ids"] + r["response_ids"] for r in stopped],
            [len(r["prompt_ids"]) for r in stopped],
            pad_id=0,
        )
    for i, r in enumerate(stopped):  # the EOS position (pad id == eos id) is part of the mask
        n = len(r["response_ids"])
        assert mask[i].sum() == n
        assert abs(logp[i, n - 1].item() - r["behavior_logprobs"][-1]) < 1e-5


def test_chat_prompts_use_the_chat_template(make_config, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    rows = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)}
        for i in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, cfg = make_config(generate={"prompts": str(data)}, score={"reward_functions": []})
    run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg)
    assert t.column("prompt").to_pylist()[0] == "<|im_start|>user\nsay 0<|im_end|>\n<|im_start|>assistant\n"
    assert t.column("answer").to_pylist()[:4] == ["0"] * 4


def test_overlong_prompts_error_skip_or_truncate(make_config, tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a*1="}\n{"prompt": "a very long prompt"}\n')
    _, cfg = make_config(generate={"prompts": str(data), "max_prompt_tokens": 8})
    with pytest.raises(
        StageError, match=r"row 1 \(prompt_id \w+\) has 18 tokens > generate.max_prompt_tokens = 8"
    ):
        run_stage("generate", cfg, 0, quiet=True)
    _, cfg = make_config(
        name="s.toml", generate={"prompts": str(data), "max_prompt_tokens": 8, "overlong": "skip"}
    )
    m = run_stage("generate", cfg, 0, quiet=True, force=True)
    assert m["rows"] == 4 and m["prompt_counts"]["prompts_skipped_overlong"] == 1
    _, cfg = make_config(
        name="t.toml", generate={"prompts": str(data), "max_prompt_tokens": 8, "overlong": "truncate_left"}
    )
    m = run_stage("generate", cfg, 0, quiet=True, force=True)
    assert (
        m["prompt_counts"]["prompts_truncated"] == 1 and m["prompt_counts"]["prompts_skipped_overlong"] == 0
    )
    t = rollouts(cfg)
    long_ids, long_text = t.column("prompt_ids").to_pylist()[-1], t.column("prompt").to_pylist()[-1]
    # the char-level tokenizer has one token per character: the last 8 characters are kept
    assert len(long_ids) == 8 and long_text == "g prompt"
    assert long_ids == load_tokenizer(cfg.policy_model)("g prompt", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "prompt file not found"),
        ("", "the prompt file is empty"),
        ('{"text": "x"}\n', "no 'prompt' or 'messages' column (columns: text)"),
        ('{"prompt": "x"}\n{"prompt": null}\n', "row 1: column 'prompt' is null or empty"),
        ('{"prompt": 3}\n', "column 'prompt' must hold strings"),
        (
            '{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n',
            "rows 0 and 1 have the same id 'a' in id column 'id'",
        ),
        ('{"prompt": "x", "response": "y"}\n', "column 'response' clashes with a rollouts column"),
        ('{"prompt": "x"\n', "cannot read prompts"),
    ],
)
def test_bad_prompt_files(make_config, tmp_path: Path, content: str | None, needle: str) -> None:
    data = tmp_path / "bad.jsonl"
    if content is not None:
        data.write_text(content)
    _, cfg = make_config(generate={"prompts": str(data)})
    with pytest.raises(StageError, match="bad.jsonl") as e:
        run_stage("generate", cfg, 0, quiet=True)
    assert needle in str(e.value)
    assert not (Path(cfg.run_dir) / "iter=0000/rollouts/_manifest.json").exists()


def test_iteration_that_skips_one_is_refused(make_config) -> None:
    _, cfg = make_config()
    with pytest.raises(StageError, match="iteration 0 has no trained policy"):
        run_stage("generate", cfg, 1, quiet=True)


def test_resume_after_a_kill_mid_write_gives_the_rows_of_an_uninterrupted_run(
    make_config, tmp_path: Path
) -> None:
    path, cfg = make_config()
    env = {
        **os.environ,
        faults.FAULT_ENV: "rollouts:part-1:tmp",
    }  # SIGKILL between writing and renaming part 1
    cmd = [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--quiet"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert killed.returncode == -9
    assert len(list(layout.folder(cfg.run_dir, 0, "rollouts").glob(".part-*.tmp"))) == 1
    sdir = layout.folder(cfg.run_dir, 0, "rollouts")
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0)]
    assert not (sdir / layout.MANIFEST).exists()
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    _, clean = make_config(run_dir=str(tmp_path / "clean"), name="clean.toml")
    run_stage("generate", clean, 0, quiet=True)
    assert rollouts(cfg).to_pylist() == rollouts(clean).to_pylist()
    assert not list(sdir.glob(".*.tmp"))  # the killed writer's temporary file was cleaned up


def test_prompts_from_a_datasets_dir_and_from_parquet(make_config, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = {"id": ["p0", "p1"], "prompt": ["a*2=", "b*1="], "answer": ["aa", "b"]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    pq.write_table(pa.table(rows), tmp_path / "p.parquet")
    tables = []
    for i, source in enumerate((tmp_path / "ds", tmp_path / "p.parquet")):
        _, cfg = make_config(
            run_dir=str(tmp_path / f"run{i}"), name=f"c{i}.toml", generate={"prompts": str(source)}
        )
        run_stage("generate", cfg, 0, quiet=True)
        tables.append(rollouts(cfg))
    assert tables[0].column("prompt_id").to_pylist() == ["p0"] * 4 + ["p1"] * 4
    assert tables[0].column("answer").to_pylist() == ["aa"] * 4 + ["b"] * 4
    assert tables[0].select(["rollout_id", "response_ids"]) == tables[1].select(
        ["rollout_id", "response_ids"]
    )


def test_a_tokenizer_without_a_pad_token_uses_eos(make_config, tmp_path: Path) -> None:
    path = init_model(tmp_path / "nopad", pad="none", seed=4)
    assert "pad_token" not in json.loads((path / "tokenizer_config.json").read_text())
    _, cfg = make_config(policy_model=str(path))
    m = run_stage("generate", cfg, 0, quiet=True)
    assert m["rows"] == 48


def test_configured_prompt_id_and_messages_column_names(make_config, tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "a*1=", "uid": "first"}\n{"question": "b*2=", "uid": "second"}\n')
    _, cfg = make_config(
        generate={"prompts": str(data), "prompt_column": "question", "id_column": "uid"},
        score={"reward_functions": []},
    )
    run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg)
    assert t.column("prompt_id").to_pylist() == ["first"] * 4 + ["second"] * 4
    assert t.column("prompt").to_pylist()[::4] == ["a*1=", "b*2="]
    assert "question" not in t.column_names and "uid" not in t.column_names  # used, not carried
    chat = tmp_path / "c.jsonl"
    chat.write_text(json.dumps({"uid": "c0", "conv": [{"role": "user", "content": "hi"}]}) + "\n")
    _, cfg = make_config(
        name="c.toml",
        generate={"prompts": str(chat), "messages_column": "conv", "id_column": "uid"},
        score={"reward_functions": []},
    )
    run_stage("generate", cfg, 0, quiet=True, force=True)
    t = rollouts(cfg)
    assert t.column("prompt").to_pylist()[0] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.column("prompt_id").to_pylist() == ["c0"] * 4


def test_progress_bar_shows_rollouts_and_tokens_per_second_unless_quiet(make_config, capsys) -> None:
    _, cfg = make_config()
    run_stage("generate", cfg, 0, quiet=False)
    err = capsys.readouterr().err
    assert "generate" in err and "rollout/s" in err and "tok_s=" in err
    run_stage("generate", cfg, 0, quiet=True, force=True)
    assert capsys.readouterr().err == ""


def test_iteration_k_samples_from_the_policy_trained_in_iteration_k_minus_1(make_config) -> None:
    _, cfg = make_config()
    prev = layout.policy_dir(cfg.run_dir, 0)
    init_model(prev, seed=7)  # another real model in train's output place (same tokenizer)
    done = output.claim(layout.folder(cfg.run_dir, 0, "train"), "train", {"test": True}, {})
    done.finish(0)  # iteration 0's train stage is complete
    run_stage("generate", cfg, 1, quiet=True)
    t = rollouts(cfg, 1).to_pylist()
    # the policy column: relative to the run directory (a run can be moved)
    assert t and all(r["policy"] == "iter=0000/policy" and r["rollout_id"].startswith("0001-") for r in t)
    new, old = (load_model(p, "policy", dtype="float32") for p in (str(prev), cfg.policy_model))
    rows = [r for r in t if r["response_ids"]][:4]
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    p_lens = [len(r["prompt_ids"]) for r in rows]
    with torch.no_grad():
        lp_new, mask, _ = response_logprobs(new, seqs, p_lens, cfg.generate.temperature, pad_id=1)
        lp_old, _, _ = response_logprobs(old, seqs, p_lens, cfg.generate.temperature, pad_id=1)
    beh = [torch.tensor(r["behavior_logprobs"]) for r in rows]
    assert all(torch.allclose(lp_new[i][mask[i]], b, atol=1e-5) for i, b in enumerate(beh))
    assert not all(torch.allclose(lp_old[i][mask[i]], b, atol=1e-3) for i, b in enumerate(beh))


def test_changing_reward_or_ref_model_does_not_refuse_complete_rollouts(make_config, tmp_path: Path) -> None:
    # the rollouts depend on the policy, the prompts and [generate], not on what scores them
    _, cfg = make_config()
    m = run_stage("generate", cfg, 0, quiet=True)
    other = tmp_path / "other-model"
    _, changed = make_config(name="b.toml", reward_model=str(other), ref_model=str(other))
    assert run_stage("generate", changed, 0, quiet=True) == m  # complete: nothing is redone, nothing refused
    assert executor.is_done(generate.Generate(changed, 0))  # and `run` skips it
    _, hotter = make_config(name="c.toml", generate={"temperature": 0.5})
    assert not executor.is_done(generate.Generate(hotter, 0))
    with pytest.raises(StageError, match=r"config.generate.temperature: 1.0 on disk, 0.5 now"):
        run_stage("generate", hotter, 0, quiet=True)


def test_prompt_batches_follow_the_seeded_epoch_order_and_are_recorded(
    make_config, demo_prompts: Path
) -> None:
    from rlhf_batch.core.prompt_batches import epoch_order
    from rlhf_batch.data.prompts import run_iterations

    # 12 prompts, B = 5: 12 // 5 = 2 iterations per epoch (2 rows of each epoch unused)
    _, cfg = make_config("[generate]\nprompts_per_iteration = 5", seed=3)
    file_ids = [json.loads(line)["id"] for line in demo_prompts.read_text().splitlines()]
    taken = []
    for it in range(3):
        if it:  # a stand-in for iteration it-1's trained policy
            init_model(layout.policy_dir(cfg.run_dir, it - 1), seed=it)
            output.claim(layout.folder(cfg.run_dir, it - 1, "train"), "train", {"test": True}, {}).finish(0)
        m = run_stage("generate", cfg, it, quiet=True)
        ids = rollouts(cfg, it).column("prompt_id").to_pylist()
        assert m["rows"] == len(ids) == 5 * 4
        taken.append((m["prompt_batch"], list(dict.fromkeys(ids))))
    # iteration 0: epoch 0 positions [0, 5); 1: epoch 0 [5, 10); 2: epoch 1 [0, 5)
    assert [(b["epoch"], b["positions"]) for b, _ in taken] == [(0, [0, 5]), (0, [5, 10]), (1, [0, 5])]
    for b, ids in taken:
        order = epoch_order(12, 3, b["epoch"])
        assert b["rows"] == order[b["positions"][0] : b["positions"][1]].tolist()
        assert ids == [file_ids[r] for r in b["rows"]] and b["prompts_in_set"] == 12
    assert not set(taken[0][1]) & set(taken[1][1])  # one epoch takes each prompt at most once
    # the run is sized in epochs: 2 epochs x 2 iterations
    _, by_epochs = make_config("[generate]\nprompts_per_iteration = 5", epochs=2, name="e.toml")
    assert run_iterations(by_epochs) == 4
    _, too_big = make_config(
        "[generate]\nprompts_per_iteration = 13", name="big.toml", run_dir=str(cfg.run_dir) + "2"
    )
    with pytest.raises(
        StageError, match="generate.prompts_per_iteration: prompts_per_iteration = 13 exceeds the 12"
    ):
        run_stage("generate", too_big, 0, quiet=True)


def test_stops_on_every_end_token_never_samples_pad_and_keeps_special_tokens_in_the_text(make_config) -> None:
    # At temperature 50 the tiny model samples nearly uniformly over its 105 tokens: in 12 x 16
    # rollouts of up to 16 tokens, each special token would appear ~20+ times if it could.
    _, cfg = make_config(generate={"temperature": 50.0, "num_generations": 16, "max_new_tokens": 16})
    m = run_stage("generate", cfg, 0, quiet=True)
    tok = load_tokenizer(cfg.policy_model)
    eos, pad, unk, im_start, im_end = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|endoftext|>", "<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>")
    )
    rows = rollouts(cfg).to_pylist()
    assert all(pad not in r["response_ids"] for r in rows)  # never sampled
    ends = {r["response_ids"][-1] for r in rows if r["finish_reason"] == "stop"}
    assert ends == {eos, im_end}  # the chat template's end of turn ends a response too
    for r in rows:
        body = r["response_ids"][:-1] if r["finish_reason"] == "stop" else r["response_ids"]
        assert eos not in body and im_end not in body  # nothing after an end token
        assert r["response"] == tok.decode(body, skip_special_tokens=False)
    holding = [r for r in rows if {unk, im_start} & set(r["response_ids"])]
    assert holding and all("<|unk|>" in r["response"] or "<|im_start|>" in r["response"] for r in holding)
    assert m["counts"]["with_special_tokens"] == len(holding)
