"""Speculative decoding units: n-gram lookup on hand-made sequences, greedy verification, and the
rejection sampler's output distribution equal to the target's (chi-square, fixed seed)."""
import pytest
import torch

from kvserve.engine.sampler import sampling_kernel, sampling_probs
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.rejection import verify_greedy, verify_sampled, verify_sampled_logits
from kvserve.spec_decode.verify import verify

# chi-square critical value, 5 degrees of freedom, alpha = 0.001: 20.515 (NIST/SEMATECH e-Handbook, table 1.3.6.7.4)
CHI2_5DOF_P001 = 20.515


def test_ngram_longest_most_recent_match():
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    # suffix [7, 8] occurs at 0 (followed by 1 2 3) and at 5 (followed by 9 4 7): most recent wins
    assert p.propose([7, 8, 1, 2, 3, 7, 8, 9, 4, 7, 8]) == [9, 4, 7]
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([5, 6, 5], max_tokens=1) == [6]
    assert NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=2).propose([1, 2, 9, 1, 2]) == [9, 1]


def test_verify_greedy_accepts_prefix_plus_bonus():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 7, 2]):
        logits[i, t] = 5.0  # target argmax at each position
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 7]  # third proposal wrong -> target's 7
    assert verify_greedy(logits, [3, 4, 7]) == [3, 4, 7, 2]  # all accepted + bonus
    assert verify_greedy(logits, [9, 4, 7]) == [3]


def _chi2(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_first_token_matches_target_distribution():
    """The first emitted token's distribution equals p whatever the (deterministic or random) draft."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    target = torch.stack([p, torch.full((6,), 1 / 6)])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    n = 20000
    for draft_probs, proposal_fn in ((None, lambda: [3]), (q, lambda: [int(torch.multinomial(q[0], 1, generator=g))])):
        counts = [0] * 6
        for _ in range(n):
            counts[verify_sampled(target, proposal_fn(), draft_probs, g)[0]] += 1
        assert _chi2(counts, p.tolist(), n) < CHI2_5DOF_P001, counts
    # a sampler that ignored rejection (always keeping the proposal) fails the same test
    assert _chi2([0, 0, 0, n, 0, 0], p.tolist(), n) > CHI2_5DOF_P001


def _kernel_or_skip():
    if sampling_kernel(torch.zeros(1, 8)) is None:
        pytest.skip("no compiled kernel (no C compiler, or KVSERVE_NO_KV_KERNEL)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.3, top_p=0.9),
                                      dict(temperature=0.7, top_k=40, min_p=0.05), dict(temperature=1.0, top_p=0.3)])
def test_kernel_probability_of_a_proposal_and_its_residual_draw(dtype, settings):
    """sample_rows_excluding against PyTorch's sampling_probs on the same logits (normalised): the proposed
    token's probability (also 0 for one outside the kept set) within float32 rounding, and for 300 values of u the
    token a float64 inverse CDF over those probabilities, with the proposal zeroed, picks (where u is not
    within 1e-6 of a boundary)."""
    from kvserve.engine.sampler import sample_rows_excluding
    _kernel_or_skip()
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 3000, generator=g) * 2).to(dtype)
    params = SamplingParams(**settings)
    probs = sampling_probs(logits.float(), [params] * 3).double()
    probs /= probs.sum(dim=-1, keepdim=True)  # min-p leaves the rows short of 1
    order = probs.argsort(dim=-1, descending=True)
    proposals = [int(order[0, 0]), int(order[1, 3]), int(order[2, -1])]  # the top token, a kept one, a cut one
    us = (torch.arange(300, dtype=torch.float64) + 0.5) / 300
    checked = 0
    for u in us:
        ids, p = sample_rows_excluding(logits, params, torch.full((3,), float(u), dtype=torch.float64), proposals)
        for r, tok in enumerate(proposals):
            assert p[r] == pytest.approx(float(probs[r, tok]), rel=1e-5, abs=1e-9), (r, tok)
            residual = probs[r].clone()
            residual[tok] = 0.0
            cdf = residual.cumsum(-1)
            target = float(u) * float(cdf[-1])
            if float((cdf - target).abs().min() / cdf[-1]) > 1e-6:
                assert ids[r] == int((cdf <= target).sum()), (r, float(u))
                checked += 1
            assert ids[r] != tok and residual[ids[r]] > 0
    assert probs[2, proposals[2]] == 0 or settings == dict(temperature=0.8)  # the premise: a cut token
    assert checked > 850


@pytest.mark.parametrize("path,settings", [("kernel", dict(temperature=0.7, top_p=0.8)),
                                           ("kernel", dict(temperature=1.0, min_p=0.5)),
                                           ("pytorch", dict(temperature=1.0, min_p=0.5))])
def test_verify_on_logits_first_token_matches_target_distribution(path, settings, monkeypatch):
    """verify() on raw logits with a one-hot proposal, on the sampling kernel (top-p, min-p) and on the
    PyTorch path (min-p): the first emitted token is distributed as sampling_probs's row normalised (top-p
    0.8 and min-p 0.5 each leave out some tokens, and min-p leaves the row summing to 0.75, which the
    PyTorch path once took for probabilities: it accepted a proposal of probability 0.4 with 0.3),
    whether the proposal is likely, kept but unlikely, or outside the kept set (chi-square, 4,000 draws
    each)."""
    import kvserve.spec_decode.verify as verify_mod
    if path == "kernel":
        _kernel_or_skip()
    else:
        monkeypatch.setattr(verify_mod, "sampling_kernel", lambda logits: None)
    logits = torch.log(torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])).repeat(2, 1)
    params = SamplingParams(seed=1, **settings)
    p = sampling_probs(logits.clone(), [params] * 2)[0].double()
    p /= p.sum()
    assert (p == 0).sum() >= 2  # the premise: some tokens are left out
    g = torch.Generator().manual_seed(0)
    n = 4000
    unlikely = 3 if settings.get("min_p") else 2
    for proposed in (1, unlikely, 0):  # likely, kept but unlikely, left out
        counts = [0] * 6
        for _ in range(n):
            counts[verify(logits, [proposed], params, g)[0]] += 1
        assert _chi2(counts, p.tolist(), n) < CHI2_5DOF_P001, (proposed, counts)
        assert all(c == 0 for c, q in zip(counts, p.tolist()) if q == 0)


def test_kernel_verification_leaves_nan_rows_to_pytorch():
    """A NaN in the row whose draw is needed: verify_sampled_logits says so (None) and verify() answers
    from the PyTorch path, a token id in the vocabulary."""
    _kernel_or_skip()
    logits = torch.zeros(2, 50)
    logits[0, 7] = float("nan")
    params = SamplingParams(temperature=1.0)
    assert verify_sampled_logits(logits, [3], params, torch.Generator().manual_seed(0)) is None
    out = verify(logits, [3], params, torch.Generator().manual_seed(0))
    assert 1 <= len(out) <= 2 and all(0 <= t < 50 for t in out)


def test_draft_model_without_draft_method_is_an_error():
    """A draft model named beside ngram (or no method) would be ignored without a word: ConfigError
    naming both fields. With method 'draft' the same config validates."""
    import pytest

    from kvserve.config import ConfigError, SpecDecodeConfig

    for method in ("ngram", None):
        with pytest.raises(ConfigError, match=r"draft_model 'tiny-llama'.*speculative_method 'draft'"):
            SpecDecodeConfig(method=method, draft_model="tiny-llama").validate()
    assert SpecDecodeConfig(method="draft", draft_model="tiny-llama").validate().draft_model == "tiny-llama"
    assert SpecDecodeConfig(method="ngram").validate().method == "ngram"


def test_every_spec_decode_field_is_checked_even_with_speculation_off():
    """Out-of-range settings were accepted silently when speculative_method was None (adversarial
    helper): each is a ConfigError naming its field, with or without a method."""
    import pytest

    from kvserve.config import ConfigError, SpecDecodeConfig

    bad = [("num_speculative_tokens", 0), ("num_speculative_tokens", 99), ("prompt_lookup_min", 5),
           ("prompt_lookup_min", 1.5), ("draft_load_format", "bogus"), ("min_acceptance_rate", float("nan")),
           ("min_acceptance_rate", 2.0), ("min_drafts", -3), ("draft_kv_cache_memory_bytes", 0)]
    for method in (None, "ngram"):
        for field, value in bad:
            with pytest.raises(ConfigError, match=field.split("_min")[0]):
                SpecDecodeConfig(method=method, prompt_lookup_max=2, **{field: value}).validate()
    with pytest.raises(ConfigError, match="draft_load_format 'dummy' is used only with speculative_method 'draft'"):
        SpecDecodeConfig(method="ngram", draft_load_format="dummy").validate()
    assert SpecDecodeConfig(method=None, prompt_lookup_max=2).validate().method is None
