"""Evaluation metrics over N sampled responses per prompt: mean@n, best@n, pass@k, maj@n.

Pure math: no I/O, no models, plain Python floats. The input is one ``PromptSamples`` per
prompt (its data source, the reward of each of its ``n`` samples, optionally each sample's
extracted answer); the output is one dict of metrics per data source.

Per prompt, with rewards ``r_1..r_n`` and ``c`` = number of *correct* samples (the caller's
judgement when given, else ``r_i >= threshold``; the default threshold 1.0 fits 0/1 rule rewards):

* ``mean@n`` = ``sum(r_i) / n``                  (the average reward of one sample)
* ``best@n`` = ``max(r_i)``                       (the reward of the best of the n samples)
* ``pass@k`` = ``1 - C(n-c, k) / C(n, k)``        (Chen et al. 2021, unbiased estimator of the
  probability that at least one of k samples drawn without replacement from the n is correct).
  Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``: no binomial coefficient is formed, so no
  overflow at large n. ``n - c < k`` gives exactly 1.0 (every k-subset holds a correct sample),
  ``c = 0`` gives exactly 0.0. Requires ``1 <= k <= n``.
* ``maj@n`` = correctness (1.0 or 0.0) of the answer given most often among the samples that
  have one (``None`` = no answer extracted, no vote); ties go to the answer seen first; no
  answer at all gives 0.0. Only computed when every prompt carries answers.

A data source's metric is the unweighted mean over its prompts. Metric names carry the common
``n`` of the prompts (``mean@8``); prompts with different sample counts are refused, since their
numbers would not be the same quantity. Rewards must be finite: a null reward has no place in
a metric, the caller fills or drops it first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptSamples:
    """The ``n`` samples of one prompt. ``answers`` (optional) has one entry per sample."""

    prompt_id: str
    data_source: str
    rewards: tuple[float, ...]
    answers: tuple[str | None, ...] | None = None
    correct: tuple[bool, ...] | None = None  # given: each sample's correctness; else reward >= threshold


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i; an empty product (c = 0) is 1.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_n(rewards: Sequence[float]) -> float:
    """Average reward of the samples of one prompt."""
    return math.fsum(rewards) / len(rewards)


def best_at_n(rewards: Sequence[float]) -> float:
    """Best reward among the samples of one prompt."""
    return max(rewards)


def maj_at_n(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """1.0 if the most frequent answer (first seen wins a tie) is correct, else 0.0."""
    if len(answers) != len(correct):
        raise ValueError(f"maj@n needs one answer per sample: {len(answers)} answers, {len(correct)} samples")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    # The winner is correct if the samples that gave it were judged correct (the first one decides).
    return 1.0 if correct[answers.index(winner)] else 0.0


def prompt_metrics(samples: PromptSamples, ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
    """All metrics of one prompt, keyed ``mean@n``, ``best@n``, ``pass@k`` (each k), ``maj@n``."""
    rewards = samples.rewards
    n = len(rewards)
    if n == 0:
        raise ValueError(f"prompt {samples.prompt_id!r} has no samples")
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"prompt {samples.prompt_id!r} has a non-finite reward {bad[0]}")
    correct = list(samples.correct) if samples.correct is not None else [r >= threshold for r in rewards]
    out = {f"mean@{n}": mean_at_n(rewards), f"best@{n}": best_at_n(rewards)}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, sum(correct), k)
    if samples.answers is not None:
        out[f"maj@{n}"] = maj_at_n(samples.answers, correct)
    return out


def aggregate(groups: Iterable[PromptSamples], ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
    """Mean over prompts of each prompt metric, plus ``prompts`` (the count). Empty -> ``{}``."""
    rows = list(groups)
    if not rows:
        return {}
    sizes = {len(g.rewards) for g in rows}
    if len(sizes) > 1:
        raise ValueError(f"prompts have different sample counts {sorted(sizes)}; metrics need one n")
    if len({g.answers is None for g in rows}) > 1:
        raise ValueError("some prompts carry answers and others do not; maj@n needs all or none")
    per_prompt = [prompt_metrics(g, ks, threshold) for g in rows]
    out = {key: math.fsum(m[key] for m in per_prompt) / len(per_prompt) for key in per_prompt[0]}
    out["prompts"] = float(len(per_prompt))
    return out


def aggregate_by_source(
    groups: Iterable[PromptSamples], ks: Sequence[int], threshold: float = 1.0
) -> dict[str, dict[str, float]]:
    """``aggregate`` per data source, sources in sorted order. For all sources at once, call
    ``aggregate`` on every group."""
    by_source: dict[str, list[PromptSamples]] = {}
    for g in groups:
        by_source.setdefault(g.data_source, []).append(g)
    return {src: aggregate(by_source[src], ks, threshold) for src in sorted(by_source)}


def group_samples(
    prompt_ids: Sequence[str],
    data_sources: Sequence[str],
    rewards: Sequence[float],
    answers: Sequence[str | None] | None = None,
    correct: Sequence[bool] | None = None,
) -> list[PromptSamples]:
    """Group flat per-sample columns (one row per response, as in a Parquet table) by prompt,
    in order of first appearance. A prompt whose rows disagree on the data source is refused.
    `correct` (optional): each sample's correctness, judged by the caller."""
    n = len(prompt_ids)
    if (
        len(data_sources) != n
        or len(rewards) != n
        or any(x is not None and len(x) != n for x in (answers, correct))
    ):
        raise ValueError("prompt_ids, data_sources, rewards (and answers, correct) must have the same length")
    source: dict[str, str] = {}
    rew: dict[str, list[float]] = {}
    ans: dict[str, list[str | None]] = {}
    ok: dict[str, list[bool]] = {}
    for i, pid in enumerate(prompt_ids):
        if source.setdefault(pid, data_sources[i]) != data_sources[i]:
            raise ValueError(f"prompt {pid!r} has two data sources: {source[pid]!r} and {data_sources[i]!r}")
        rew.setdefault(pid, []).append(float(rewards[i]))
        if answers is not None:
            ans.setdefault(pid, []).append(answers[i])
        if correct is not None:
            ok.setdefault(pid, []).append(bool(correct[i]))
    return [
        PromptSamples(
            pid,
            source[pid],
            tuple(rew[pid]),
            tuple(ans[pid]) if answers is not None else None,
            tuple(ok[pid]) if correct is not None else None,
        )
        for pid in rew
    ]


def with_overall(manifest: dict[str, Any], dedupe: bool = False) -> dict[str, dict[str, float]]:
    """An eval manifest's metrics per data source and, under ``overall``, over every prompt
    (`dedupe`: not when the only source is ``all``, whose numbers are the overall ones)."""
    out = dict(manifest.get("metrics") or {})
    if manifest.get("overall") and not (dedupe and set(out) == {"all"}):
        out["overall"] = manifest["overall"]
    return out
