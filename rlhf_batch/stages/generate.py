"""generate: G samples per prompt with the iteration's policy, into iter=K/rollouts.

Rows are decoded in batches of similar prompt length (left-padded, KV cache). Finished rows
leave the batch and its cache, so they stop costing compute. Each row draws its randomness
from its own generator, seeded by (seed, rollout_id): a rollout does not depend on which other
rows shared its batch (up to the floating-point effects of batch shape). The behaviour log-prob
of each sampled token is log_softmax(logits / temperature) over the full vocabulary in float32
(before top-k / top-p filtering), the same definition score and train use.

Ends and special tokens: a row stops on every end token the model declares (the tokenizer's
EOS, each id of `generation_config.eos_token_id`, which may be a list, and the token a chat
template closes an assistant turn with, e.g. `<|im_end|>`). The pad token is never sampled
(unless it is also a stop token): it is filtered out like top-k, the log-prob keeps the full
vocabulary. `response` is the text the model wrote with special tokens kept (`<|unk|>`,
`<|im_start|>`, ...), only the final stop token left out, so a reward function sees them; the
manifest counts the rollouts holding one (`with_special_tokens`).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import pyarrow as pa

from rlhf_batch import dist, shards
from rlhf_batch.config import Config, GenerateConfig
from rlhf_batch.errors import StageError
from rlhf_batch.prompts import Prompts, check_path, load_prompts
from rlhf_batch.schemas import ROLLOUTS, with_extra


def policy_for(cfg: Config, iteration: int) -> str:
    """Iteration 0 samples from the configured model, iteration K from train's output of K-1."""
    if iteration < 0:
        raise StageError(f"--iter must be >= 0, got {iteration}")
    if iteration == 0:
        from rlhf_batch.models import check_model_dir

        return str(check_model_dir(cfg.policy_model, "policy_model"))
    prev = shards.policy_dir(cfg.run_dir, iteration - 1)
    if shards.manifest(shards.stage_dir(cfg.run_dir, iteration - 1, "train")) is None or not prev.is_dir():
        raise StageError(
            f"iteration {iteration}: iteration {iteration - 1} has no trained policy ({prev}); "
            f"run train --iter {iteration - 1} first"
        )
    return str(prev)


def rollout_id(iteration: int, prompt_id: str, sample_idx: int) -> str:
    return f"{iteration:04d}-{prompt_id}-{sample_idx}"


def row_seed(seed: int, rid: str) -> int:
    return int(hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()[:15], 16)


def identity(cfg: Config) -> dict[str, Any]:
    """The config that decides this stage's result (recorded in, and compared with, its manifest)."""
    return cfg.stage_dict("generate")


def run(cfg: Config, iteration: int, *, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    from rlhf_batch.models import load_model, load_tokenizer, model_fingerprint

    if cfg.demo:
        from rlhf_batch.tiny import ensure_demo_assets

        ensure_demo_assets(cfg)
    policy = policy_for(cfg, iteration)
    g = cfg.generate
    sdir = shards.stage_dir(cfg.run_dir, iteration, "rollouts")
    inputs = {
        "prompts": shards.file_fingerprint(check_path(g.prompts)),
        "policy": model_fingerprint(policy, "policy"),
        "iteration": iteration,
    }
    stage = shards.StageRun(sdir, "rollouts", identity(cfg), inputs, force, cfg.to_dict())
    if stage.complete:
        return shards.manifest(sdir) or {}
    tok = load_tokenizer(policy, cfg.trust_remote_code)
    prompts = load_prompts(g, tok, iteration, cfg.seed)
    n_parts = math.ceil(len(prompts.ids) / g.prompts_per_part)
    todo = stage.todo(n_parts)
    if todo:
        model = load_model(
            policy,
            "policy",
            device=dist.stage_device(cfg.device),
            dtype=cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
        )
        shards.fault_point("rollouts:model-loaded")
        _check_lengths(model, prompts, g)
        schema = with_extra(ROLLOUTS, prompts.carried.schema)
        bar = _progress(len(todo) * g.prompts_per_part * g.num_generations, quiet)
        for n in todo:
            table = generate_part(model, tok, prompts, n, cfg, iteration, policy, bar)
            counts = {"rollouts": table.num_rows, "with_special_tokens": _with_special(table, model, tok)}
            stage.write(n, table, schema, counts)
        bar.close()
    extra = {"prompt_counts": prompts.counts, "policy": policy, "prompt_batch": prompts.batch}
    return stage.finish(n_parts, extra=extra) or {}


def _check_lengths(model: Any, prompts: Prompts, g: GenerateConfig) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(t) for t in prompts.tokens)
    if limit and longest + g.max_new_tokens > limit:
        raise StageError(
            f"{g.prompts}: longest prompt ({longest} tokens) + generate.max_new_tokens "
            f"({g.max_new_tokens}) exceeds the model's {limit} positions"
        )


def generate_part(
    model: Any, tok: Any, prompts: Prompts, n: int, cfg: Config, iteration: int, policy: str, bar: Any
) -> pa.Table:
    """All rollouts of the prompts in part n, in (prompt, sample) order."""
    from rlhf_batch.sampler import sample

    g = cfg.generate
    idx = list(range(n * g.prompts_per_part, min((n + 1) * g.prompts_per_part, len(prompts.ids))))
    rows = [(i, s) for i in idx for s in range(g.num_generations)]  # (prompt index, sample index)
    rids = [rollout_id(iteration, prompts.ids[i], s) for i, s in rows]
    order = sorted(range(len(rows)), key=lambda r: (-len(prompts.tokens[rows[r][0]]), r))
    results: list[Any] = [None] * len(rows)
    stop_ids = _stop_ids(model, tok)
    for start in range(0, len(order), g.batch_size):
        batch = order[start : start + g.batch_size]
        t0 = time.perf_counter()
        out = sample(
            model,
            [prompts.tokens[rows[r][0]] for r in batch],
            [row_seed(cfg.seed, rids[r]) for r in batch],
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            stop_ids=stop_ids,
            pad_id=tok.pad_token_id,
            banned_ids={tok.pad_token_id} - stop_ids,
        )
        for r, res in zip(batch, out, strict=True):
            results[r] = res
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{sum(len(o[0]) for o in out) / (time.perf_counter() - t0):.0f}")
    columns = {
        "rollout_id": rids,
        "prompt_id": [prompts.ids[i] for i, _ in rows],
        "sample_idx": [s for _, s in rows],
        "prompt": [prompts.texts[i] for i, _ in rows],
        "prompt_ids": [prompts.tokens[i] for i, _ in rows],
        "response": tok.batch_decode(
            [r[0][:-1] if r[0] and r[0][-1] in stop_ids else r[0] for r in results], skip_special_tokens=False
        ),
        "response_ids": [r[0] for r in results],
        "behavior_logprobs": [r[1] for r in results],
        "finish_reason": [r[2] for r in results],
        "policy": [policy] * len(rows),
    }
    table = pa.table({k: pa.array(v, ROLLOUTS.field(k).type) for k, v in columns.items()})
    carried = prompts.carried.take(pa.array([i for i, _ in rows], pa.int64()))
    for name in carried.column_names:
        table = table.append_column(carried.schema.field(name), carried.column(name))
    return table


def _stop_ids(model: Any, tok: Any) -> set[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    extra = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    return ids | _end_of_turn(tok)


def _special_ids(tok: Any) -> set[int]:
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return set(tok.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _end_of_turn(tok: Any) -> set[int]:
    """The special token the chat template closes an assistant turn with (none without one)."""
    if not getattr(tok, "chat_template", None):
        return set()
    marker = "ZQXJ"
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    try:
        text = tok.apply_chat_template(turn, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render an assistant turn has no end token to add
        return set()
    if not isinstance(text, str) or marker not in text:
        return set()
    ids = tok(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    return {ids[0]} if ids and ids[0] in _special_ids(tok) else set()


def _with_special(table: pa.Table, model: Any, tok: Any) -> int:
    """Rollouts whose response holds a special token before its final stop token."""
    stops, special = _stop_ids(model, tok), _special_ids(tok)
    n = 0
    for ids in table.column("response_ids").to_pylist():
        body = ids[:-1] if ids and ids[-1] in stops else ids
        n += any(i in special for i in body)
    return n


def _progress(total: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="rollout", desc="generate", disable=quiet, leave=False)
