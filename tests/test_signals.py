import math

import pytest
import torch

from tracelock.signals import apply_cfg, compute_signals, filter_top_p_top_k


def _ref_signals(logits, eos_id, temperature=0.0, tempered=False, proposal=None):
    """float64 softmax reference of every signal."""
    x = logits.double()
    if tempered and temperature > 0:
        x = x / temperature
    p = x.softmax(dim=-1)
    if proposal is None:
        proposal = logits.float().argmax(dim=-1)
    top2 = p.topk(2, dim=-1).values
    return {
        "proposal": proposal,
        "confidence": p.gather(-1, proposal.unsqueeze(-1)).squeeze(-1),
        "margin": top2[..., 0] - top2[..., 1],
        "neg_entropy": torch.special.xlogy(p, p).sum(dim=-1),
        "eos_prob": p[..., eos_id],
    }


def _assert_matches(sig, ref, atol=1e-6):
    assert torch.equal(sig.proposal, ref["proposal"])
    for field in ("confidence", "margin", "neg_entropy", "eos_prob"):
        got = getattr(sig, field)
        assert got.dtype == torch.float32, field
        torch.testing.assert_close(got.double(), ref[field], rtol=0, atol=atol, msg=field)


@pytest.mark.parametrize(
    "shape", [(1, 1, 7), (3, 5, 50), (2, 63, 257), (1, 8, 4096)], ids=lambda s: "B{}-R{}-V{}".format(*s)
)
def test_signals_match_float64_softmax(shape):
    logits = torch.randn(shape) * 3
    sig = compute_signals(logits, eos_id=2)
    _assert_matches(sig, _ref_signals(logits, eos_id=2))
    assert (sig.neg_entropy <= 0).all()
    assert (sig.margin >= 0).all()


def test_signals_bf16_input():
    logits = (torch.randn(2, 9, 100) * 4).bfloat16()
    sig = compute_signals(logits, eos_id=0)
    # the reference sees the same bf16 values, upcast exactly
    _assert_matches(sig, _ref_signals(logits, eos_id=0))


def test_signals_tie_goes_to_lowest_index():
    logits = torch.tensor([[[0.0, 1.0, 3.0, -2.0, 0.5, 3.0]]])
    sig = compute_signals(logits)
    assert sig.proposal.item() == 2
    assert sig.margin.item() == 0.0


def test_signals_hand_values():
    # two tokens with logits log 3 and 0: p = (3/4, 1/4)
    logits = torch.tensor([[[math.log(3.0), 0.0]]])
    sig = compute_signals(logits, eos_id=1)
    assert sig.proposal.item() == 0
    assert sig.confidence.item() == pytest.approx(0.75, abs=1e-7)
    assert sig.margin.item() == pytest.approx(0.5, abs=1e-7)
    assert sig.eos_prob.item() == pytest.approx(0.25, abs=1e-7)
    assert sig.neg_entropy.item() == pytest.approx(0.75 * math.log(0.75) + 0.25 * math.log(0.25), abs=1e-7)


def test_signals_eos_none_and_minus_inf_columns():
    logits = torch.randn(2, 4, 20)
    # logits_eos_inf-style masking: -inf columns have p = 0 and add nothing to the entropy
    logits[..., 3] = float("-inf")
    sig = compute_signals(logits)
    assert torch.equal(sig.eos_prob, torch.zeros(2, 4))
    assert torch.isfinite(sig.neg_entropy).all()
    _assert_matches(sig, _ref_signals(logits, eos_id=3) | {"eos_prob": torch.zeros(2, 4, dtype=torch.float64)})


@pytest.mark.parametrize("tempered", [False, True])
def test_signals_sampled_scores(tempered):
    logits = torch.randn(2, 30, 16) * 2
    gen = torch.Generator().manual_seed(1)
    sig = compute_signals(logits, eos_id=5, temperature=0.7, generator=gen, tempered=tempered)
    # LLaDA scores the sample under softmax(logits), Dream under softmax(logits / T)
    _assert_matches(sig, _ref_signals(logits, 5, 0.7, tempered, proposal=sig.proposal))
    again = compute_signals(logits, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sig.proposal, again.proposal)


def _chi2_sf_df5(x):
    """Chi-square survival function with 5 degrees of freedom (closed form for odd df)."""
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 / math.pi) * math.exp(-x / 2) * (math.sqrt(x) + x**1.5 / 3)


def test_signals_gumbel_sampling_distribution():
    n, temp = 20_000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    logits = row.expand(1, n, 6)
    sig = compute_signals(logits, temperature=temp, generator=torch.Generator().manual_seed(1234))
    freq = torch.bincount(sig.proposal.flatten(), minlength=6).double() / n
    p = (row.double() / temp).softmax(dim=0)
    # Hoeffding + union bound over 6 categories: P(max |f - p| > eps) <= 12 exp(-2 n eps^2) = 1e-6
    eps = math.sqrt(math.log(12 / 1e-6) / (2 * n))
    assert (freq - p).abs().max().item() <= eps
    # the bound has power: ignoring T (sampling softmax(logits)) would be off by far more than 2 eps
    assert (row.double().softmax(dim=0) - p).abs().max().item() > 4 * eps
    # Pearson chi-square, 5 dof, smallest expected count ~190: P(chi2 > 37) = 6e-7 < 1e-6
    assert _chi2_sf_df5(37.0) < 1e-6
    chi2 = (((freq - p) ** 2) / p).sum().item() * n
    assert chi2 <= 37.0


def test_apply_cfg():
    cond, un = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    # un + (s + 1)(cond - un) with s = 1: (0.5 + 2 * 0.5, 3 + 2 * -1)
    assert torch.equal(apply_cfg(cond, un, 1.0), torch.tensor([1.5, 1.0]))
    assert apply_cfg(cond, un, 0.0) is cond


def test_filter_top_p_top_k():
    # p = softmax(log(0.5, 0.3, 0.15, 0.05)) = (0.5, 0.3, 0.15, 0.05); cumulative 0.5, 0.8, 0.95, 1.0
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    low = torch.finfo(torch.float32).min
    # top_p 0.7: the token crossing 0.7 (the second) is kept, the rest removed
    assert torch.equal(filter_top_p_top_k(logits, top_p=0.7), torch.tensor([logits[0], logits[1], low, low]))
    assert torch.equal(filter_top_p_top_k(logits, top_k=3), torch.tensor([*logits[:3].tolist(), low]))
    assert torch.equal(filter_top_p_top_k(logits, top_p=1.0), logits)
    # at T = 0.5, p ∝ p^2 = (0.25, 0.09, ...) / 0.365: the first alone holds 0.68 > 0.6
    kept = filter_top_p_top_k(logits, top_p=0.6, temperature=0.5)
    assert torch.equal(kept, torch.tensor([logits[0], low, low, low]))


def test_signals_rejects_negative_temperature():
    with pytest.raises(ValueError, match="temperature"):
        compute_signals(torch.zeros(1, 1, 3), temperature=-1.0)
