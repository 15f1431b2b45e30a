"""Speculative decoding units: n-gram lookup on hand-made sequences, greedy verification, and the
rejection sampler's output distribution equal to the target's (chi-square, fixed seed)."""
import torch

from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.rejection import verify_greedy, verify_sampled

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
