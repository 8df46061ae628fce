"""GSPO (sequence ratios), CISPO and the masked importance-sampling modes of `grpo_loss`.

Expected values are worked out by hand in the comments; the `*_as_trl` / `*_as_verl` tests
re-implement the other trainer's snippet as read (TRL: huggingface/trl at commit f2cd577,
1.10.0.dev0, trl/trainer/grpo_trainer.py `_compute_loss` and the importance-sampling block of
`_generate_and_score_completions`; verl: volcengine/verl at commit b178a3c, 0.8.0.dev,
verl/trainer/ppo/core_algos.py `compute_policy_loss_gspo` / `compute_policy_loss_cispo`) and
compare numbers and gradients. trl and verl are not imported.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_batch.core.losses import grpo_loss
from rlhf_batch.core.objectives import is_weights, sequence_log_ratio

T_ = torch.tensor


def close(x: torch.Tensor, expected: float, tol: float = 1e-5) -> None:
    assert x.item() == pytest.approx(expected, abs=tol), (x.item(), expected)


def leaf(values: list[list[float]]) -> torch.Tensor:
    return T_(values, dtype=torch.float64).requires_grad_(True)


# ---------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_clipped_per_sequence_by_hand() -> None:
    # row 0: log-ratios 0.1, 0.3 -> mean 0.2 -> s = e^0.2 = 1.221403 > 1 + 0.2 with A = 1: the clip
    # binds for the whole row; each token's term is -min(1.221403, 1.2) = -1.2, zero gradient.
    # row 1: log-ratios 0.1, -0.1 -> mean 0 -> s = 1, A = 2: term -2 per token; the gradient of
    # -A s_t (value s, gradient s dlogp_t) under seq_mean_token_mean is -A s / 2 = -1 per token.
    # loss = mean over rows of the row means = (-1.2 + -2) / 2 = -1.6; both rows' token counts are
    # 2, so the loss's gradient per token is half the row's: row 1 -> -0.5 each.
    old = T_([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    logp = leaf([[0.1, 0.3], [0.1, -0.1]])
    out = grpo_loss(
        logp, old, T_([1.0, 2.0]), torch.ones(2, 2, dtype=torch.bool),
        ratio_level="sequence", aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2,
    )  # fmt: skip
    close(out.loss, -1.6)
    out.loss.backward()
    assert torch.allclose(logp.grad, T_([[0.0, 0.0], [-0.5, -0.5]], dtype=torch.float64))
    close(out.clip_fraction, 0.5)  # the 2 tokens of row 0 of 4
    close(out.ratio_mean, (2 * math.exp(0.2) + 2 * 1.0) / 4)  # (2.442806 + 2) / 4 = 1.110701


def test_gspo_ratio_ignores_padding_and_is_the_geometric_mean() -> None:
    # real log-ratios 0.2, 0.4 (the third position is padding holding nan): mean 0.3; the padded
    # position's value is 0 whatever it held
    logp = T_([[0.2, 0.4, float("nan")]])
    mask = T_([[True, True, False]])
    log_s = sequence_log_ratio(logp, torch.zeros(1, 3), mask)
    assert torch.allclose(log_s, T_([[0.3, 0.3, 0.0]]))


def test_gspo_log_ratio_is_clamped_at_ten_as_verl() -> None:
    # mean log-ratio 30 -> clamped to 10 (verl: torch.clamp(log_seq_importance_ratio, max=10.0))
    log_s = sequence_log_ratio(T_([[30.0, 30.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert torch.equal(log_s, T_([[10.0, 10.0]]))


def _trl_sequence_loss(per_token_logps, old_per_token_logps, advantages, mask, eps_low, eps_high):  # type: ignore[no-untyped-def]
    # TRL (f2cd577) grpo_trainer.py `_compute_loss`, importance_sampling_level="sequence", loss_type="grpo"
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _verl_gspo_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):  # type: ignore[no-untyped-def]
    # verl (b178a3c) core_algos.py `compute_policy_loss_gspo`, its agg_loss "seq-mean-token-mean"
    # written out as the mean over rows of each row's masked token mean
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return ((pg_losses * response_mask).sum(-1) / seq_lengths).mean()


def _random_case(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3  # [4, 6]
    old = logp + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(4, generator=g, dtype=torch.float64)  # [4]
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False  # rows of different lengths
    mask[3, 2:] = False
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_trl_and_verl(seed: int) -> None:
    logp, _, _, mask = _random_case(seed)
    g = torch.Generator().manual_seed(50 + seed)
    # rows' mean log-ratios about +1e-3, +1e-3, -1e-4, -1e-3 with A = 1, -1, 1, -1: the clip binds on
    # rows 0 and 3 (s > 1 + 4e-4 with A > 0, s < 1 - 3e-4 with A < 0), not on rows 1 and 2
    shift = T_([[1e-3], [1e-3], [-1e-4], [-1e-3]], dtype=torch.float64)
    old = logp - shift + torch.randn(4, 6, generator=g, dtype=torch.float64) * 1e-5
    adv = T_([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    lo, hi = 3e-4, 4e-4  # GSPO's clip range
    ours = leaf(logp.tolist())
    out = grpo_loss(
        ours,
        old,
        adv,
        mask,
        ratio_level="sequence",
        aggregation="seq_mean_token_mean",
        eps_low=lo,
        eps_high=hi,
    )
    out.loss.backward()
    for reference in (
        lambda x: _trl_sequence_loss(x, old, adv.unsqueeze(-1), mask.double(), lo, hi),
        lambda x: _verl_gspo_loss(old, x, adv.unsqueeze(-1), mask.double(), lo, hi),
    ):
        theirs = leaf(logp.tolist())
        loss = reference(theirs)
        loss.backward()
        assert torch.allclose(out.loss, loss, atol=1e-12)
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-12)
    assert 0 < out.clip_fraction.item() < 1  # the case exercises clipped and unclipped rows


# ---------------------------------------------------------------------------- CISPO


def test_cispo_by_hand_every_token_keeps_a_gradient() -> None:
    # log-ratios 0.5 and 2.0: r = e^0.5 = 1.648721 and e^2 = 7.389056 -> weights 1.648721 and 5
    # (cispo_max 5); A = 1, logp = -1, -2. loss_tok = -w A logp = 1.648721 and 10;
    # token_mean: 11.648721 / 2 = 5.824361. Gradient (w is constant): -w A / 2 = -0.824361 and -2.5,
    # where PPO's clip (r > 1.2, A > 0) would leave both at 0. The cap binds on 1 token of 2.
    logp = leaf([[-1.0, -2.0]])
    out = grpo_loss(
        logp, T_([[-1.5, -4.0]], dtype=torch.float64), T_([1.0]), torch.ones(1, 2, dtype=torch.bool),
        loss_type="cispo", cispo_max=5.0,
    )  # fmt: skip
    close(out.loss, 5.824361)
    out.loss.backward()
    assert torch.allclose(logp.grad, T_([[-0.824361, -2.5]], dtype=torch.float64), atol=1e-6)
    close(out.clip_fraction, 0.5)


def _trl_cispo_loss(per_token_logps, old_per_token_logps, advantages, mask, epsilon_high):  # type: ignore[no-untyped-def]
    # TRL (f2cd577) `_compute_loss`, loss_type="cispo", importance_sampling_level="token"; its
    # normalizer num_items_in_batch / num_processes is the batch's token count on one process
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped_ratios * advantages * per_token_logps
    normalizer = mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / normalizer


def _verl_cispo_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):  # type: ignore[no-untyped-def]
    # verl (b178a3c) `compute_policy_loss_cispo`, agg_loss "token-mean" as the masked token mean.
    # verl bounds the weight to [1 - low, 1 + high]; with low = 1 and high = cap - 1 that is
    # [0, cap], i.e. TRL's (and ours) upper bound alone.
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_trl_and_verl(seed: int) -> None:
    logp, _, adv, mask = _random_case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    old = logp + torch.randn(4, 6, generator=g, dtype=torch.float64)  # ratios well past the cap of 2
    cap = 2.0
    ours = leaf(logp.tolist())
    out = grpo_loss(ours, old, adv, mask, loss_type="cispo", cispo_max=cap)
    out.loss.backward()
    for reference in (
        lambda x: _trl_cispo_loss(x, old, adv.unsqueeze(-1), mask.double(), cap),
        lambda x: _verl_cispo_loss(old, x, adv.unsqueeze(-1), mask.double(), 1.0, cap - 1.0),
    ):
        theirs = leaf(logp.tolist())
        loss = reference(theirs)
        loss.backward()
        assert torch.allclose(out.loss, loss, atol=1e-12)
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-12)
    assert 0 < out.clip_fraction.item() < 1


# ---------------------------------------------------------------------------- masked IS


def test_token_mask_drops_tokens_outside_the_band_by_hand() -> None:
    # d = old - behaviour = 0, 1.5, -1: w = 1, e^1.5 = 4.481689, e^-1 = 0.367879; band [0.5, 3]
    # keeps only the first: weights 1, 0, 0, 2 tokens of 3 masked. On policy (logp = old), A = 1:
    # terms -1, 0, 0 -> token_mean -1/3. Truncation at 3 instead: -(1 + 3 + 0.367879) / 3 = -1.455960.
    old = T_([[0.0, 0.0, 0.0]])
    behaviour = T_([[0.0, -1.5, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    kw = {"behavior_logprobs": behaviour, "tis_cap": 3.0}
    out = grpo_loss(old.clone(), old, T_([1.0]), mask, tis_mode="mask", tis_low=0.5, **kw)
    close(out.loss, -1 / 3)
    close(out.tis_masked, 2 / 3)
    out = grpo_loss(old.clone(), old, T_([1.0]), mask, **kw)  # truncate, the default
    close(out.loss, -1.455960)
    close(out.tis_masked, 0.0)


def test_sequence_mask_drops_whole_rows_by_hand() -> None:
    # row 0: d = 0.2, 0.3 -> product ratio e^0.5 = 1.648721, inside [0, 3]: both tokens weigh it;
    # row 1: d = 1.0, 0.5 -> e^1.5 = 4.481689 > 3: the row is dropped. A = 1 on policy:
    # terms -1.648721 x 2 and 0 x 2 -> token_mean -3.297443 / 4 = -0.824361; masked 2 of 4 tokens.
    old = torch.zeros(2, 2)
    behaviour = T_([[-0.2, -0.3], [-1.0, -0.5]])
    out = grpo_loss(
        old.clone(), old, T_([1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool),
        behavior_logprobs=behaviour, tis_cap=3.0, tis_mode="sequence_mask",
    )  # fmt: skip
    close(out.loss, -0.824361)
    close(out.tis_masked, 0.5)


def _trl_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):  # type: ignore[no-untyped-def]
    # TRL (f2cd577) grpo_trainer.py `_generate_and_score_completions`, vllm_importance_sampling_mode
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(
            vllm_importance_sampling_ratio, min=clip_min, max=clip_max
        )
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (
            vllm_importance_sampling_ratio > max_val
        )
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(
            invalid_mis_mask, value=0.0
        )
    return vllm_importance_sampling_ratio


@pytest.mark.parametrize(("ours", "trl", "low"), [("truncate", "token_truncate", None), ("mask", "token_mask", 0.5),
                                                  ("sequence_mask", "sequence_mask", 0.5)])  # fmt: skip
def test_importance_weights_match_trl(ours: str, trl: str, low: float | None) -> None:
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(5, 4, generator=g, dtype=torch.float64)
    behaviour = old + torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.6
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[2, 3:] = False
    d = torch.where(mask, old - behaviour, 0.0)
    weights, masked = is_weights(d, mask, ours, low or 0.0, 2.0)
    theirs = _trl_is_ratio(old, behaviour, mask.double(), trl, low, 2.0).expand_as(d)
    assert torch.allclose(torch.where(mask, weights, 0.0), torch.where(mask, theirs, 0.0), atol=1e-12)
    if ours != "truncate":  # masked: exactly the real tokens TRL zeroes
        assert torch.equal(masked, mask & (theirs == 0))
        assert 0 < masked.sum() < mask.sum()


@pytest.mark.parametrize("mode", ["mask", "sequence_mask"])
@pytest.mark.parametrize(("low", "cap"), [(1.0, 3.0), (0.5, 1.0)])
def test_mask_band_keeps_weights_exactly_at_its_edges(mode: str, low: float, cap: float) -> None:
    # d = old - behaviour = 0 on both tokens: w = e^0 = 1 exactly (token and row product alike),
    # sitting on the band's edge (low = 1 or cap = 1). The band [low, cap] is closed (TRL masks
    # w < min or w > max only): both tokens keep weight 1. On policy, A = 1: terms -1, -1 ->
    # token_mean -1, nothing masked. An open edge would drop both: loss 0, masked 1.
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = grpo_loss(
        old.clone(),
        old,
        T_([1.0]),
        mask,
        behavior_logprobs=old.clone(),
        tis_cap=cap,
        tis_mode=mode,
        tis_low=low,
    )
    close(out.loss, -1.0)
    close(out.tis_masked, 0.0)
    weights, masked = is_weights(torch.zeros(1, 2), mask, mode, low, cap)
    assert weights.tolist() == [[1.0, 1.0]] and not masked.any()


def test_sequence_mask_product_ratio_leaves_out_environment_tokens() -> None:
    # A multi-turn row: token 1 is the environment's (loss_mask 0, so mask False), and there the
    # trainer's log-prob (old) is far from the engine's, which never sampled it (behaviour 0):
    # d = old - behaviour = 0.1, [4.0 on the environment token], 0.2.
    # The row's product ratio takes the policy's tokens only: e^(0.1 + 0.2) = e^0.3 = 1.349859,
    # inside [0, 3]: both real tokens weigh it. On policy (logp = old), A = 1:
    # terms -1.349859 x 2 -> token_mean -1.349859; nothing masked.
    # Were the environment token counted: e^4.3 = 73.7 > 3, the row dropped: loss 0, masked 1.
    old = T_([[-0.9, -4.0, -0.8]])
    behaviour = T_([[-1.0, 0.0, -1.0]])
    mask = T_([[True, False, True]])
    out = grpo_loss(
        old.clone(), old, T_([1.0]), mask, behavior_logprobs=behaviour, tis_cap=3.0, tis_mode="sequence_mask"
    )
    close(out.loss, -1.349859)
    close(out.tis_masked, 0.0)


def test_row_stats_by_hand() -> None:
    from rlhf_batch.core.objectives import ROW_STATS, row_stats

    # row 0 has tokens 0 and 1, row 1 token 0 only; the other positions are padding (any value)
    mask = T_([[True, True, False], [True, False, False]])
    ratio = T_([[0.5, 0.8, 9.0], [0.6, 7.0, 7.0]])  # means 0.65, 0.6; maxima 0.8, 0.6
    weights = T_([[1.0, 0.0, 5.0], [2.0, 5.0, 5.0]])  # means 0.5, 2.0
    binds = T_([[True, False, True], [False, True, True]])  # on real tokens: 1, 0
    masked = T_([[False, True, True], [True, True, False]])  # on real tokens: 1, 1
    entropy = T_([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0]])  # means 1.5, 3.0
    logp = T_([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    behaviour = T_([[-1.5, -1.0, 0.0], [-0.25, 0.0, 0.0]])  # |logp - behaviour|: 0.5, 1.0; 0.25
    got = row_stats(ratio, weights, binds, masked, entropy, logp, behaviour, mask)
    assert got.shape == (2, len(ROW_STATS))
    expected = [[0.65, 0.8, 0.5, 1.0, 1.0, 1.5, 1.0], [0.6, 0.6, 2.0, 0.0, 1.0, 3.0, 0.25]]
    assert torch.allclose(got, T_(expected)), got
    # no importance weights: 1 per row; no entropy: nan
    got = row_stats(ratio, None, binds, masked, None, logp, behaviour, mask)
    assert got[:, 2].tolist() == [1.0, 1.0] and torch.isnan(got[:, 5]).all()


def test_one_token_rows_and_the_cispo_cap_edge() -> None:
    from rlhf_batch.core.objectives import cispo_tokens

    # GSPO on a row of one real token: the mean log-ratio is that token's, -1.0 - -1.5 = 0.5
    log_s = sequence_log_ratio(T_([[-1.0, 3.0]]), T_([[-1.5, 0.0]]), T_([[True, False]]))
    assert log_s.tolist() == [[0.5, 0.0]]
    # CISPO: a ratio exactly at the cap is not truncated (the cap binds above it)
    _, binds = cispo_tokens(T_([[2.0, 2.5]]), T_([[-1.0, -1.0]]), T_([[1.0, 1.0]]), T_([[True, True]]), 2.0)
    assert binds.tolist() == [[False, True]]
