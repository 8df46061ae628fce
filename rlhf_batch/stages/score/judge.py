"""An LLM judge as a reward (`score.judge_model`): a causal LM grades rollouts, its verdict text
and the score parsed from it become the scores columns ``judge_verdict`` and ``judge_score``.

Two modes (`score.judge_mode`):

* ``pointwise``: one judge prompt per rollout, the template's fields ``{prompt}``,
  ``{response}``, ``{rubric}`` and every carried prompt column (``{answer}``, ...); the score is
  the first match of `score.judge_pattern` (its first group, a number) in the verdict.
* ``group`` (RULER-style): one judge prompt per prompt's group of rollouts in a score part, with
  ``{prompt}``, ``{rubric}``, ``{n}`` and ``{responses}`` (the group's responses, numbered from
  1 in rollouts order); the pattern has two groups, the response's number and its score, and a
  number the verdict does not score gets none. The judge compares the responses with each
  other, so a score is relative to its group (which GRPO's advantage is anyway).

The judge decodes greedily (top-k 1: the same prompt gives the same verdict), up to
`score.judge_max_new_tokens` tokens, stopping at its end of turn. The rendered text is the
content of one user message when the judge's tokenizer has a chat template (then the template
with its generation prompt), else the text as it is. It runs on generate's engine: our sampler
(`hf`), or vLLM's engine kept in the process (`generate.engine = "vllm"`, the score stage then
running in `generate.python`), which loads the judge's weights in place of the policy's when
both have one architecture. `score.judge_parser = "module:function"` replaces the pattern: it
gets the verdict text and returns a number or None (pointwise), or the group's size as a
second argument and returns one number or None per response (group).

A verdict the pattern (or parser) finds no finite number in gives ``judge_score`` null (the
rollout is then unscored, as for a reward function's None) and counts in the manifest as
``judge_unparsed``; it never fails the stage. With `score.reward_cache` the verdicts are cached
under ``reward_cache/judge/<identity>/``: the identity hashes the judge's weights (its model
fingerprint), template, rubric, mode, pattern or parser source and token budget; the key is the
rollout's content key (rewards/cache.py), in group mode the keys of the whole group and the
rollout's place in it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from rlhf_batch.core.verdicts import (
    PATTERNS,
    RUBRIC,
    TEMPLATES,
    groups_of,
    numbered,
    parse_group,
    parse_pointwise,
    pattern_problem,
)
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.rewards import RewardFunction, import_function

SCORE, VERDICT = "judge_score", "judge_verdict"  # the scores columns it writes
UNPARSED = "judge_unparsed"  # the manifest count of verdicts without a score


class Judge:
    """The judge of one score run: its model on generate's engine, its settings and identity."""

    def __init__(self, cfg: Any, device: Any, cache: Any = None):
        from rlhf_batch.models.load import load_tokenizer
        from rlhf_batch.store.modeldir import model_fingerprint

        s = cfg.score
        self.cfg, self.mode, self.cache = cfg, s.judge_mode, cache
        self.template = s.judge_template or TEMPLATES[self.mode]
        self.rubric = s.judge_rubric or RUBRIC
        self.pattern = s.judge_pattern or PATTERNS[self.mode]
        if problem := pattern_problem(self.pattern, self.mode):
            raise ConfigError(problem)
        self.parser: Callable[..., Any] | None = (
            import_function(s.judge_parser, "score.judge_parser") if s.judge_parser else None
        )
        self.tok = load_tokenizer(s.judge_model, cfg.trust_remote_code)
        self.model: Any = None
        self.engine: Any = None
        if cfg.generate.engine == "vllm":
            from rlhf_batch.engines.vllm import shared_engine

            self.engine = shared_engine(s.judge_model, cfg)
        else:
            from rlhf_batch.models.load import load_model

            self.model = load_model(
                s.judge_model,
                "score.judge_model",
                device=device,
                dtype=cfg.dtype,
                trust_remote_code=cfg.trust_remote_code,
            )
        parser_src = inspect.getsource(inspect.getmodule(self.parser) or self.parser) if self.parser else ""
        weights = model_fingerprint(s.judge_model, "score.judge_model")
        settings = {
            "model": weights.get("content") or weights.get("sha256"),
            "mode": self.mode,
            "template": self.template,
            "rubric": self.rubric,
            "pattern": "" if self.parser else self.pattern,
            "parser": [s.judge_parser, parser_src] if self.parser else None,
            "max_new_tokens": s.judge_max_new_tokens,
        }
        self.identity = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        # the reward cache keeps the verdicts like a function's, in its folder `judge`
        self.slot = RewardFunction("score.judge_model", self.score, 1.0, alias="judge")

    def score(
        self, batch: dict[str, Any], prompt_ids: Sequence[str]
    ) -> tuple[list[float | None], list[str], int]:
        """(judge_score, judge_verdict, unparsed count) of the rows of `batch` (cache.table_batch's
        keyword lists; `prompt_ids` the rows' prompt ids)."""
        from rlhf_batch.rewards.cache import content_keys

        n = len(batch["prompts"])
        units = [[i] for i in range(n)] if self.mode == "pointwise" else groups_of(prompt_ids)
        content = content_keys(batch)
        keys = [""] * n
        for rows in units:
            whole = "\n".join(content[i] for i in rows)
            for place, i in enumerate(rows):
                keys[i] = hashlib.sha256(f"{whole}\n{place}".encode()).hexdigest()
        known = self.cache.entries(self.slot, self.identity) if self.cache is not None else {}
        todo = [u for u in units if any(keys[i] not in known for i in u)]
        found: dict[str, tuple[float | None, str | None]] = dict(known)
        if todo:
            verdicts = self.decode([self.render(batch, u) for u in todo])
            new_keys, new_values, new_texts = [], [], []
            for rows, verdict in zip(todo, verdicts, strict=True):
                for i, v in zip(rows, self.parse(verdict, len(rows)), strict=True):
                    found[keys[i]] = (v, json.dumps([[VERDICT, verdict]]))
                    new_keys.append(keys[i])
                    new_values.append(v)
                    new_texts.append(found[keys[i]][1])
            if self.cache is not None:
                self.cache.store(self.slot, self.identity, new_keys, new_values, new_texts)
        values = [found[k][0] for k in keys]
        texts = [str(dict(json.loads(found[k][1] or "[]")).get(VERDICT, "")) for k in keys]
        return values, texts, sum(v is None for v in values)

    def render(self, batch: dict[str, Any], rows: list[int]) -> str:
        first = rows[0]
        fields: dict[str, Any] = {c: v[first] for c, v in batch["columns"].items()}
        fields.update(prompt=batch["prompts"][first], rubric=self.rubric)
        if self.mode == "pointwise":
            fields["response"] = batch["responses"][first]
        else:
            fields.update(n=len(rows), responses=numbered([batch["responses"][i] for i in rows]))
        return self.template.format_map(fields)

    def parse(self, verdict: str, n: int) -> list[float | None]:
        """One score or None per row of a unit (pointwise: one row)."""
        if self.parser is None:
            if self.mode == "pointwise":
                return [parse_pointwise(verdict, self.pattern)]
            return parse_group(verdict, self.pattern, n)
        got = self.parser(verdict) if self.mode == "pointwise" else self.parser(verdict, n)
        values = [got] if self.mode == "pointwise" else list(got) if isinstance(got, Sequence) else []
        if len(values) != n:
            raise StageError(
                f"score.judge_parser {self.cfg.score.judge_parser} returned {got!r} for a group of {n}; "
                f"it must return {n} numbers or None"
            )
        return [
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None
            for v in values
        ]

    def encode(self, text: str) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
            return ids
        return list(self.tok(text)["input_ids"])

    def decode(self, texts: list[str]) -> list[str]:
        """The judge's greedy continuation of each rendered prompt, as text."""
        from rlhf_batch.engines.base import stop_ids

        s = self.cfg.score
        prompts = [self.encode(t) for t in texts]
        config = self.model.config if self.model is not None else None
        limit = getattr(config, "max_position_embeddings", None) if config is not None else None
        limit = limit or (self.engine.max_model_len if self.engine is not None else None)
        longest = max(len(p) for p in prompts)
        if limit and longest + s.judge_max_new_tokens > limit:
            raise StageError(
                f"score.judge_model: a judge prompt of {longest} tokens + score.judge_max_new_tokens "
                f"({s.judge_max_new_tokens}) exceeds the judge's {limit} positions"
            )
        if self.engine is not None:
            from types import SimpleNamespace

            from rlhf_batch.engines.vllm import sample_rows

            g = SimpleNamespace(
                prompts="score.judge_model",
                max_new_tokens=s.judge_max_new_tokens,
                temperature=0.0,  # vLLM: greedy
                top_p=1.0,
                top_k=0,
                seed_per_rollout=True,
            )
            stops = stop_ids_of(self.tok)
            rows = sample_rows(self.engine, prompts, [0] * len(prompts), g, stops)
        else:
            rows = self._decode_hf(prompts, stop_ids(self.model, self.tok))
        return [self.tok.decode(ids, skip_special_tokens=True) for ids, _, _ in rows]

    def _decode_hf(
        self, prompts: list[list[int]], stops: set[int]
    ) -> list[tuple[list[int], list[float], str]]:
        from rlhf_batch.engines.hf import auto_rows
        from rlhf_batch.engines.sampler import sample

        new = self.cfg.score.judge_max_new_tokens
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Any] = [None] * len(prompts)
        start = 0
        while start < len(order):
            rows = auto_rows(self.model, len(prompts[order[min(len(order), start + 64) - 1]]), new)
            batch = order[start : start + rows]
            got = sample(
                self.model,
                [prompts[i] for i in batch],
                [0] * len(batch),  # top-k 1: the draw never matters
                max_new_tokens=new,
                top_k=1,
                stop_ids=stops,
                pad_id=int(self.tok.pad_token_id if self.tok.pad_token_id is not None else 0),
            )
            for i, row in zip(batch, got, strict=True):
                out[i] = row
            start += len(batch)
        return out


def stop_ids_of(tok: Any) -> set[int]:
    """The judge tokenizer's EOS and end of turn (vLLM's engine has no transformers model)."""
    from rlhf_batch.engines.base import end_of_turn

    return ({tok.eos_token_id} if tok.eos_token_id is not None else set()) | end_of_turn(tok)
