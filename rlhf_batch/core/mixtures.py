"""Weighted prompt mixtures: how many prompts of each source batch k takes, and which (no I/O).

Sources i = 0..S-1 of n_i prompts with weights w_i; B = generate.prompts_per_iteration.

Quotas. Batch k's expected share of source i is e_i = B w_i / W (W = sum of the weights). Each
source gets floor(e_i), and the r = B - sum floor(e_i) prompts left go to r distinct sources by
systematic sampling over the fractional parts f_i = e_i - floor(e_i) (they sum to r): with one
uniform u of [0, 1) seeded by (seed, k), source i gets one more when one of u, u + 1, ...,
u + r - 1 falls in its interval [F_{i-1}, F_i) of the running sums F. So source i gets
floor(e_i) + 1 with probability exactly f_i: its quota is e_i on average and never more than
one off. The arithmetic is exact (fractions), so no rounding decides a quota.

Order. Each source is read in epochs of its own permutation, seeded by (seed, i + 1, epoch).
Batch k takes positions [p, p + q) of source i's current epoch; when fewer than q positions
are left the rest of the epoch is dropped (as a data loader's drop_last) and the next epoch,
reshuffled, starts: no prompt comes twice in one batch. A source's quota may not exceed its
size (ceil(e_i) <= n_i). The positions depend only on (sizes, weights, B, seed, k): a run that
goes straight through, is resumed or extended samples the same prompts at the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

KEYS = ("path", "weight", "name")  # of one source of generate.prompts


@dataclass(frozen=True)
class SourceTake:
    quota: int
    epoch: int
    start: int  # positions [start, stop) of the source's epoch order
    stop: int


def quotas(batch: int, weights: list[float], per_iteration: int, seed: int) -> list[int]:
    """Batch `batch`'s prompts of each source (they sum to `per_iteration`)."""
    total = sum(Fraction(w) for w in weights)
    expected = [Fraction(per_iteration) * Fraction(w) / total for w in weights]
    out = [math.floor(e) for e in expected]
    left = per_iteration - sum(out)
    if left:
        u = Fraction(float(np.random.default_rng([seed, batch]).random()))
        running, j = Fraction(0), 0
        for i, e in enumerate(expected):
            running += e - math.floor(e)
            while j < left and u + j < running:  # at most once per source: each part < 1
                out[i] += 1
                j += 1
    return out


def check(sizes: list[int], weights: list[float], per_iteration: int) -> None:
    """ValueError naming the first source whose largest quota exceeds its size."""
    if per_iteration < 1:
        raise ValueError("weighted sources need prompts_per_iteration >= 1")
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"every weight must be > 0, got {weights}")
    total = sum(Fraction(w) for w in weights)
    for i, (n, w) in enumerate(zip(sizes, weights, strict=True)):
        most = math.ceil(Fraction(per_iteration) * Fraction(w) / total)
        if most > n:
            raise ValueError(f"source {i} has {n} prompts, fewer than its quota of up to {most} per batch")


def takes(
    batch: int, sizes: list[int], weights: list[float], per_iteration: int, seed: int
) -> list[SourceTake]:
    """What batch `batch` takes of each source, replaying the batches before it."""
    check(sizes, weights, per_iteration)
    state = [(0, 0)] * len(sizes)  # (epoch, next position) per source
    out: list[SourceTake] = []
    for b in range(batch + 1):
        out = []
        for i, q in enumerate(quotas(b, weights, per_iteration, seed)):
            epoch, pos = state[i]
            if pos + q > sizes[i]:
                epoch, pos = epoch + 1, 0
            out.append(SourceTake(q, epoch, pos, pos + q))
            state[i] = (epoch, pos + q)
    return out


def source_order(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """Source `source`'s permutation of its rows 0..n-1 in epoch `epoch`."""
    return np.random.default_rng([seed, source + 1, epoch]).permutation(n)


def rows_for(
    batch: int, sizes: list[int], weights: list[float], per_iteration: int, seed: int
) -> tuple[list[SourceTake], list[int]]:
    """Batch `batch`'s takes and its rows of the concatenated set (source 0's rows first)."""
    got = takes(batch, sizes, weights, per_iteration, seed)
    offsets = np.cumsum([0, *sizes[:-1]])
    rows: list[int] = []
    for i, t in enumerate(got):
        order = source_order(sizes[i], seed, i, t.epoch)[t.start : t.stop]
        rows += (order + offsets[i]).tolist()
    return got, rows


def spec_problem(spec: list[Any], per_iteration: int) -> str:
    """Why a mixture spec is wrong ("" when right)."""
    if not all(isinstance(x, dict) for x in spec):
        return "mixes paths and {path, weight} tables; give every source as a table"
    for i, e in enumerate(spec):
        if unknown := sorted(set(e) - set(KEYS)):
            return f"source {i}: unknown key '{unknown[0]}' (keys: {', '.join(KEYS)})"
        if not isinstance(e.get("path"), str) or not e["path"]:
            return f"source {i}: needs a 'path' (a string)"
        w = e.get("weight")
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 < w < float("inf"):
            return f"source {i}: 'weight' must be a number > 0, got {w!r}"
        if "name" in e and (not isinstance(e["name"], str) or not e["name"]):
            return f"source {i}: 'name' must be a non-empty string"
    if len(set(names(spec))) < len(spec):
        return "two sources have the same name; give each a distinct 'name'"
    if per_iteration < 1:
        return "with weights needs generate.prompts_per_iteration >= 1 (each batch takes quotas)"
    return ""


def names(spec: list[dict[str, Any]]) -> list[str]:
    """Each source's name: its `name`, else the last part of its path without a prompt file's
    suffix (`data/math.jsonl` -> `math`), so it does not depend on where the files are."""
    out = []
    for e in spec:
        last = str(e["path"]).rstrip("/").rsplit("/", 1)[-1]
        stem = next((last[: -len(s)] for s in (".jsonl", ".json", ".parquet") if last.endswith(s)), last)
        out.append(str(e.get("name") or stem))
    return out
