"""Sampler tests against hand-computed values and plain-Python references."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.sampler import Sampler, SamplingRow, apply_penalties, sample_from_probs, sampling_probs
from kvserve.sampling_params import SamplingParams


def row(params: SamplingParams | None = None, prompt=(), output=(), eos=(), seed=None) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params or SamplingParams(), gen, list(prompt), list(output), tuple(eos))


# ------------------------------------------------------------------------------------ penalties
def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[-2.0, 3.0, 1.0, -1.0]])
    out = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    # tokens 0 (prompt) and 1 (output) are seen: -2 → -4, 3 → 1.5; tokens 2, 3 unseen: unchanged
    assert out.tolist() == [[-4.0, 1.5, 1.0, -1.0]]
    same = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=1.0), prompt=[0], output=[1])])
    assert same.tolist() == logits.tolist()


def test_presence_frequency_penalty_hand_computed():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # token 3 only in the prompt → not penalised; token 1 ×3 → 1 - 0.75 - 0.5; token 2 ×1 → 1 - 0.25 - 0.5
    out = apply_penalties(logits.clone(), [row(params, prompt=[3, 3], output=[1, 2, 1, 1])])
    assert out.tolist() == [[1.0, -0.25, 0.25, 1.0]]


def test_penalties_rowwise_in_a_batch():
    logits = torch.tensor([[2.0, 2.0], [2.0, 2.0]])
    rows = [row(SamplingParams(repetition_penalty=4.0), output=[0]), row(SamplingParams(), output=[0])]
    assert apply_penalties(logits.clone(), rows).tolist() == [[0.5, 2.0], [2.0, 2.0]]


# ------------------------------------------------------------------------------------ masks vs reference
def reference_probs(logits: list[float], t: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Plain-Python temperature → top-k → top-p → min-p; ties by lower id."""
    scaled = [x / t for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    keep = set(order[:top_k] if top_k > 0 else order)
    def softmax_over(kept):
        m = max(scaled[i] for i in kept)
        z = sum(math.exp(scaled[i] - m) for i in kept)
        return {i: math.exp(scaled[i] - m) / z for i in kept}
    probs = softmax_over(keep)
    if top_p < 1.0:
        cum, nucleus = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            nucleus.add(i)
            cum += probs[i]
            if cum >= top_p:
                break
        keep = nucleus
    probs = softmax_over(keep)
    pmax = max(probs.values())
    keep = {i for i in keep if probs[i] >= min_p * pmax}
    probs = softmax_over(keep)
    return [probs.get(i, 0.0) for i in range(len(logits))]


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.2),
    (1.0, 4, 0.5, 0.1), (0.5, 2, 0.99, 0.0), (1.0, 0, 0.05, 0.0),
])
def test_masks_match_plain_python_reference(t, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g)
    logits[2, 5] = logits[2, 1]  # a tie
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = sampling_probs(logits.clone(), [params] * 3)
    for r in range(3):
        ref = reference_probs(logits[r].tolist(), t, top_k, top_p, min_p)
        got = probs[r] / probs[r].sum()
        assert [p > 0 for p in got.tolist()] == [p > 0 for p in ref]  # same support
        assert got.tolist() == pytest.approx(ref, abs=1e-6)


# ------------------------------------------------------------------------------------ greedy
def test_greedy_equivalent_settings_agree_and_break_ties_low():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1.0  # tie: 7 must win
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
                SamplingParams(temperature=0.0, top_p=0.1)]
    results = [Sampler()(logits, [row(p, seed=s) for s in range(4)]).token_ids for p in settings]
    assert results[0] == results[1] == results[2] == logits.argmax(dim=-1).tolist()
    assert results[0][3] == 7


def _first_max_or_nan(row: list[float]) -> int:
    """Plain Python: the first NaN, else the first maximum (0 for a row of -inf)."""
    for i, v in enumerate(row):
        if v != v:
            return i
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_kernel_is_first_max_or_first_nan(dtype):
    """The plain-greedy path's argmax (kvs_argmax_rows on the CPU) against plain Python and torch.max:
    rows shorter and longer than an 8- or 16-lane vector and around their edges, a 49,152-entry row (SmolLM2's
    vocabulary), heavy ties (rounded values, equal rows), -inf rows, +inf, NaN in the vector part and
    in the tail, and a non-contiguous slice."""
    from kvserve.attention import kv_quant_kernel
    from kvserve.engine.sampler import greedy_token_ids

    g = torch.Generator().manual_seed(5)
    cases = []
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 49152):  # edges of 8- (AVX2) and 16-lane (AVX-512) vectors
        x = torch.randn(4, n, generator=g)
        ties = x.round()
        nan = x.clone()
        nan[0, n // 2], nan[1, n - 1], nan[2, 0] = float("nan"), float("nan"), float("nan")
        nan[3, n - 1] = float("nan") if n > 16 else 0.0  # a NaN past the last whole vector
        inf = x.clone()
        inf[:, n // 3] = float("inf")
        inf[1, -1] = float("inf")
        cases += [x, ties, nan, inf, torch.full((2, n), float("-inf")), torch.full((2, n), 3.0)]
    wide = torch.randn(3, 200, generator=g)
    cases.append(wide[:, 7:150])  # rows 200 apart: not contiguous
    cases.append(torch._neg_view(torch.tensor([[1.0, 5.0, -3.0, 2.0] * 5])))  # the storage holds the negation
    for x in cases:
        y = x.to(dtype)
        want = [_first_max_or_nan(r) for r in y.float().tolist()]
        assert want == y.max(dim=-1).indices.tolist()  # the reference agrees with torch
        assert greedy_token_ids(y) == want
    if kv_quant_kernel.load() is None:
        pytest.skip("no C compiler: only torch's path ran")


def test_bfloat16_logits_accepted():
    logits = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.bfloat16)
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0))]).token_ids == [1]


def test_greedy_rows_with_a_penalty_or_logprobs_are_still_processed():
    """A greedy step without processors is one argmax; a greedy row with a penalty, an unmet min_tokens
    or logprobs must still get them (hand-computed: 2.0 / 1.25 = 1.6 < 1.9 flips the pick)."""
    logits = torch.tensor([[2.0, 1.9, 0.0]], dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0)
    plain = Sampler()(logits, [row(greedy, prompt=[0])])
    assert plain.token_ids == [0] and plain.logprobs == [None]
    for changed in (greedy.clone(repetition_penalty=1.25), greedy.clone(presence_penalty=0.2),
                    greedy.clone(frequency_penalty=0.2)):  # one call each: a batch is plain only if every row is
        assert Sampler()(logits, [row(changed, prompt=[0], output=[0])]).token_ids == [1]
    assert Sampler()(logits, [row(greedy.clone(min_tokens=2), output=[5], eos=(0,))]).token_ids == [1]
    lp = Sampler()(logits, [row(greedy.clone(logprobs=1))]).logprobs[0]
    assert lp.top_token_ids == [0]
    assert math.isclose(lp.logprob, 2.0 - math.log(math.exp(2.0) + math.exp(1.9) + 1.0), rel_tol=1e-2)
    tied = torch.tensor([[1.0, 3.0, 3.0], [3.0, 3.0, 3.0]], dtype=torch.bfloat16)  # ties: the lowest id
    assert Sampler()(tied, [row(SamplingParams(temperature=0.0)) for _ in range(2)]).token_ids == [1, 0]


def test_logit_bias_hand_computed():
    """OpenAI logit_bias: added to the logits before everything else; -100 bans, +100 forces; a row's
    bias touches only that row; logprobs stay the raw ones; sampled rows obey it too."""
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0], [2.0, 1.9, 0.0, -1.0]])
    greedy = SamplingParams(temperature=0.0)
    out = Sampler()(logits, [row(greedy.clone(logit_bias={0: -0.2})), row(greedy)])
    assert out.token_ids == [1, 0]  # 2.0 - 0.2 = 1.8 < 1.9 in row 0 only
    assert Sampler()(logits[:1], [row(greedy.clone(logit_bias={3: 3.5}))]).token_ids == [3]  # -1 + 3.5 = 2.5
    lp = Sampler()(logits[:1], [row(greedy.clone(logit_bias={2: 100.0}, logprobs=1))]).logprobs[0]
    assert lp.token_id == 2 and lp.top_token_ids == [0]  # logprobs of the raw logits
    assert math.isclose(lp.logprob, 0.0 - math.log(sum(math.exp(v) for v in (2.0, 1.9, 0.0, -1.0))), rel_tol=1e-5)
    hot = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0})
    assert all(Sampler()(logits[:1], [row(hot, seed=s)]).token_ids == [3] for s in range(20))


@pytest.mark.parametrize("bias,needle", [({5: 101.0}, "101"), ({5: -100.5}, "-100.5"), ({-1: 1.0}, "-1"),
                                         ({True: 1.0}, "True"), ({5: float("nan")}, "nan"), ({5: "1"}, "'1'"),
                                         ([5], "[5]"), ({"5": 1.0}, "int token ids")])
def test_logit_bias_validation_names_the_field(bias, needle):
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias" and needle in str(e.value)


def test_bad_shape_raises():
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(2, 5), [row()])


# ------------------------------------------------------------------------------------ seeded sampling
def run_seeded(steps_logits: list[torch.Tensor], companions: int) -> list[int]:
    """Sample row 0 (seed 123) for several steps, with `companions` unseeded/other-seeded rows beside it."""
    gen = torch.Generator().manual_seed(123)
    others = [torch.Generator().manual_seed(1000 + i) if i % 2 else None for i in range(companions)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    tokens = []
    for step_logits in steps_logits:
        extra = torch.randn(companions, step_logits.shape[0])
        batch = torch.cat([extra[: companions // 2], step_logits[None], extra[companions // 2:]])
        rows = [SamplingRow(SamplingParams(temperature=1.0), g, [], [], ()) for g in others]
        rows.insert(companions // 2, SamplingRow(params, gen, [], list(tokens), ()))
        tokens.append(Sampler()(batch, rows).token_ids[companions // 2])
    return tokens


def test_seeded_row_independent_of_batch_composition():
    g = torch.Generator().manual_seed(7)
    steps = [torch.randn(64, generator=g) for _ in range(12)]
    alone, beside3, beside6 = run_seeded(steps, 0), run_seeded(steps, 3), run_seeded(steps, 6)
    assert alone == beside3 == beside6
    assert len(set(alone)) > 1  # it really sampled


# Chi-square critical value for df = 7 at significance level α = 0.001: 24.322
# (NIST/SEMATECH e-Handbook of Statistical Methods, §1.3.6.7.4, upper critical values of chi-square).
CHI2_CRIT_DF7_ALPHA_0_001 = 24.322


def test_sampling_matches_softmax_chi_square():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    n = 20000
    batch = logits.repeat(n, 1)
    torch.manual_seed(2024)
    tokens = Sampler()(batch, [row(SamplingParams(temperature=1.0)) for _ in range(n)]).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=8).double()
    expected = torch.softmax(logits.double(), dim=0) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF7_ALPHA_0_001, (chi2, observed.tolist(), expected.tolist())


# ------------------------------------------------------------------------------------ logprobs
def test_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.7, logprobs=0, seed=1),
              SamplingParams(temperature=1.0)]
    out = Sampler()(logits, [row(params[0], prompt=list(range(40))), row(params[1], seed=1), row(params[2])])
    ref = torch.log_softmax(logits, dim=-1)
    lp0, lp1, lp2 = out.logprobs
    assert lp2 is None
    assert lp1.top_token_ids == [] and lp1.top_logprobs == []
    assert lp1.logprob == pytest.approx(ref[1, out.token_ids[1]].item(), abs=1e-6)
    assert lp1.rank == int((ref[1] > ref[1, out.token_ids[1]]).sum()) + 1
    assert lp0.top_token_ids == ref[0].argsort(descending=True)[:5].tolist()
    assert lp0.top_logprobs == pytest.approx(ref[0].sort(descending=True).values[:5].tolist(), abs=1e-6)
    assert lp0.top_logprobs == sorted(lp0.top_logprobs, reverse=True)
    assert all(x <= 0 for x in lp0.top_logprobs)
    assert lp0.top_token_ids[0] == int(logits[0].argmax())
    # greedy on penalised logits (all tokens seen → all scaled) still picks argmax → rank 1, entry 0
    assert lp0.token_id == out.token_ids[0] and lp0.rank == 1
    assert lp0.logprob == pytest.approx(lp0.top_logprobs[0], abs=1e-6)


def test_logprob_rank_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=3))])
    lp = out.logprobs[0]
    assert out.token_ids == [1] and lp.rank == 1
    assert lp.top_token_ids == [1, 2, 0]


# ------------------------------------------------------------------------------------ min_tokens
def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])  # 1 = EOS, 2 = stop id
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    early = Sampler()(logits, [row(params, output=[3, 3], eos=(1,))])
    assert early.token_ids == [3]
    done = Sampler()(logits, [row(params, output=[3, 3, 3], eos=(1,))])
    assert done.token_ids == [1]
    # sampled rows too: EOS and stop id never drawn before min_tokens
    sampled = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[2])
    out = Sampler()(logits.repeat(200, 1), [row(sampled, eos=(1,)) for _ in range(200)])
    assert set(out.token_ids) <= {0, 3}


# ------------------------------------------------------------------------------------ large vocabularies
def _vocab_cases(vocab: int = 3000):
    """Rows where the candidates (top-k + 1, or the NUCLEUS_CANDIDATES sizes) are fewer than the vocabulary:
    a peaked row (nucleus of a few tokens), a flat row (nucleus past 1024 tokens), a row whose top-k
    boundary is a five-way tie spread over ids (the lowest ids must win, as in a stable sort), and a row
    of 1100 tied top tokens, of which torch.topk(1024) does not return the lowest ids."""
    g = torch.Generator().manual_seed(11)
    peaked = torch.randn(vocab, generator=g) * 0.5
    peaked[torch.randperm(vocab, generator=g)[:20]] += 8.0
    flat = torch.randn(vocab, generator=g) * 0.05
    tied = torch.randn(vocab, generator=g)
    tie_ids = [2900, 17, 1500, 640, 2999]
    tied[tie_ids] = tied.max() + 1.0  # five tokens share the top value
    wide_tie = torch.randn(vocab, generator=g)
    wide_tie[torch.randperm(vocab, generator=g)[:1100]] = 5.0  # more tied tokens than topk(1024) takes
    return torch.stack([peaked, flat, tied, wide_tie])


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.9, 0.0), (0, 0.5, 0.0), (3, 1.0, 0.0), (4, 0.7, 0.0),
                                                (0, 0.95, 0.05), (1100, 0.985, 0.0), (1023, 1.0, 0.0)])
def test_large_vocab_masks_match_plain_python_reference(top_k, top_p, min_p):
    """The topk-candidate path and its fall-backs give the full-sort semantics: same support, same
    probabilities as the plain-Python reference, ties at the edge broken by the lowest id."""
    logits = _vocab_cases()
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = sampling_probs(logits.clone(), [params] * 4)
    for r in range(4):
        ref = reference_probs(logits[r].tolist(), 0.8, top_k, top_p, min_p)
        got = (probs[r] / probs[r].sum()).tolist()
        assert [i for i, p in enumerate(got) if p > 0] == [i for i, p in enumerate(ref) if p > 0], r
        assert got == pytest.approx(ref, abs=1e-6)
    if top_k == 3:  # the tie: ids 17, 640, 1500 of the five
        assert (probs[2] > 0).nonzero().flatten().tolist() == [17, 640, 1500]


def test_mixed_batch_rows_take_their_own_path():
    """Temperature-only, top-k and top-p rows in one batch: each equals the same row sampled alone."""
    logits = _vocab_cases()
    params = [SamplingParams(temperature=1.0), SamplingParams(top_k=4), SamplingParams(top_p=0.6, min_p=0.1),
              SamplingParams(top_p=0.5)]
    together = sampling_probs(logits.clone(), params)
    for r in range(4):
        alone = sampling_probs(logits[r:r + 1].clone(), [params[r]])
        assert torch.equal(together[r], alone[0]), r


def test_inverse_cdf_never_draws_a_zero_probability_token(monkeypatch):
    """u just below 1 (u·total rounds up to total) draws the last token with probability > 0, not the
    zeros after it; u = 0 draws the first token with probability > 0, not the zeros before it."""
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    for u, want in [(1.0 - 2.0 ** -53, 3), (0.0, 1)]:
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[0] if isinstance(a[0], tuple) else a,
                                                                             u, dtype=torch.float64))
        assert sample_from_probs(probs * 1e-30, [None]).tolist() == [want]
        assert sample_from_probs(probs, [torch.Generator()]).tolist() == [want]


def test_nucleus_of_ties_at_a_huge_logit_and_at_an_exact_boundary():
    """Four tokens tied at 1e8 (or +inf, clamped to the float max) share the top-p mass: top-p 0.5 keeps
    two of them, as the reference does (a normaliser m + log Σ rounds back to m there and kept one).
    1000 equal logits with top-p 0.01 keep exactly 10 (1/1000 rounds up in float32)."""
    for big in (1e8, float("inf")):
        logits = torch.zeros(1, 10)
        logits[0, :4] = big
        probs = sampling_probs(logits, [SamplingParams(top_p=0.5)])
        assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 1]
    probs = sampling_probs(torch.zeros(1, 1000), [SamplingParams(top_p=0.01)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == list(range(10))
    assert reference_probs([0.0] * 1000, 1.0, 0, 0.01, 0.0).count(0.0) == 990


def test_a_row_that_is_not_a_distribution_still_draws_a_valid_id():
    for bad in (torch.zeros(1, 7), torch.full((1, 7), float("nan"))):
        assert 0 <= sample_from_probs(bad, [None]).item() < 7


def test_two_level_cdf_search_matches_the_distribution_across_blocks():
    """Mass on both sides of block edges (255 | 256, 511 | 512) and in a last partial block of a
    1000-token vocabulary: 20,000 draws pass a chi-square test against the probabilities (df = 7)."""
    ids = [0, 255, 256, 511, 512, 700, 998, 999]
    weights = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.1])
    n = 20000
    probs = torch.zeros(n, 1000)
    probs[:, ids] = weights
    torch.manual_seed(7)
    tokens = sample_from_probs(probs, [None] * n)
    assert set(tokens.tolist()) <= set(ids)
    observed = torch.tensor([(tokens == i).sum().item() for i in ids], dtype=torch.float64)
    expected = weights.double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF7_ALPHA_0_001, (chi2, observed.tolist())


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0 ** -53])
def test_two_level_cdf_search_keeps_zeros_out_at_the_rounding_edges(u, monkeypatch):
    """Tiny masses in the middle of blocks, zeros around them: a target that rounding puts just before a
    block or past its end still draws a token of that block with probability > 0."""
    probs = torch.zeros(1, 700)
    probs[0, [3, 300, 310, 650]] = torch.tensor([1e-30, 0.3, 1e-38, 0.7])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1,), u, dtype=torch.float64))
    got = sample_from_probs(probs, [None]).item()
    assert probs[0, got] > 0
    assert got == (3 if u == 0.0 else 650)


def test_two_level_cdf_search_when_the_block_sum_exceeds_its_running_sum(monkeypatch):
    """1.0 then 200 masses of 1e-17: the block's float64 sum keeps them (1 + 2e-15), the running sum
    inside it rounds each away (1.0), so a target near the total falls past the running sum's end. The
    draw is the block's last token with probability > 0 (200), not the zero after it."""
    probs = torch.zeros(1, 256)
    probs[0, 0], probs[0, 1:201] = 1.0, 1e-17
    assert probs.sum(dtype=torch.float64) > probs.cumsum(-1, dtype=torch.float64)[0, -1]  # the premise
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1,), 1.0 - 2.0 ** -53, dtype=torch.float64))
    assert sample_from_probs(probs, [None]).item() == 200


def test_rows_that_fall_back_in_a_different_order_keep_their_own_settings():
    """Four tied rows with different settings all fall back to the full sort in the second round, in
    the order their groups came (0, 3, 1, 2): each must still get its own row's probabilities."""
    logits = torch.zeros(4, 1000)
    params = [SamplingParams(top_p=0.99), SamplingParams(top_k=50, top_p=0.99, min_p=0.99),
              SamplingParams(top_k=380, top_p=0.9, min_p=0.5), SamplingParams(top_p=0.5, min_p=0.99)]
    together = sampling_probs(logits.clone(), params)
    for r in range(4):
        assert torch.equal(together[r], sampling_probs(logits[r:r + 1].clone(), [params[r]])[0]), r


# ------------------------------------------------------------------------------------ the sampling kernel
def _kernel_or_skip():
    from kvserve.engine.sampler import sampling_kernel
    if sampling_kernel(torch.zeros(1, 8)) is None:
        pytest.skip("no compiled kernel (no C compiler, or KVSERVE_NO_KV_KERNEL)")


def inverse_cdf(probs: list[float], u: float) -> tuple[int, float]:
    """The first token whose cumulative probability (float64, in id order) exceeds u × the total, and the
    distance from u × total to the nearest cumulative boundary relative to the total (rounding decides a
    draw that close)."""
    cdf = torch.tensor(probs, dtype=torch.float64).cumsum(-1)
    target = u * float(cdf[-1])
    return int((cdf <= target).sum()), float((cdf - target).abs().min() / cdf[-1])


SAMPLING_SETTINGS = [(t, k, p, mp) for t in (0.25, 1.0, 1.9) for k, p, mp in
                     [(0, 1.0, 0.0), (0, 1.0, 0.05), (40, 1.0, 0.0), (0, 0.9, 0.0), (7, 0.8, 0.1), (0, 0.5, 0.0)]]


@pytest.mark.parametrize("vocab", [8, 255, 256, 257, 3000, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_kernel_matches_a_float64_inverse_cdf(vocab, dtype):
    """kvs_sample_rows against the plain-Python reference's probabilities (temperature, top-k, top-p,
    min-p) and a float64 inverse CDF, for vocabularies around the 256-token blocks and SmolLM2's, float32
    and bfloat16 logits (bfloat16 ties many logits, also at the top-k and top-p edges): the same token
    wherever the target is not within 1e-6 of a boundary (where rounding may decide it either way)."""
    from kvserve.engine.sampler import sample_plain_rows
    _kernel_or_skip()
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(len(SAMPLING_SETTINGS), vocab, generator=g) * 3).to(dtype)
    u = torch.rand(len(SAMPLING_SETTINGS), generator=g, dtype=torch.float64)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp) for t, k, p, mp in SAMPLING_SETTINGS]
    got = sample_plain_rows(logits, list(range(len(params))), params, u)
    checked = 0
    for r, (t, k, p, mp) in enumerate(SAMPLING_SETTINGS):
        want, margin = inverse_cdf(reference_probs(logits[r].float().tolist(), t, k, p, mp), float(u[r]))
        if margin > 1e-6:
            assert got[r] == want, (r, t, k, p, mp, got[r], want)
            checked += 1
    assert checked >= len(params) - 2


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.9, 0.0), (0, 0.5, 0.0), (3, 1.0, 0.0), (4, 0.7, 0.0),
                                                (0, 0.95, 0.05), (1100, 0.985, 0.0), (1023, 1.0, 0.0)])
def test_sampling_kernel_keeps_the_reference_set_at_ties(top_k, top_p, min_p):
    """The rows whose top-k edge is a tie spread over ids or whose nucleus ends inside 1,100 tied tokens
    (_vocab_cases): across 400 values of u the kernel draws exactly the tokens, with the frequencies, of the
    inverse CDF over the plain-Python reference's probabilities (so the same kept set, lower ids first at
    the edge)."""
    from kvserve.engine.sampler import sample_plain_rows
    _kernel_or_skip()
    logits = _vocab_cases()
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)
    us = (torch.arange(400, dtype=torch.float64) + 0.5) / 400
    for r in range(logits.shape[0]):
        probs = reference_probs(logits[r].tolist(), 1.0, top_k, top_p, min_p)
        got = sample_plain_rows(logits[r:r + 1], [0] * len(us), [params] * len(us), us)
        want = [inverse_cdf(probs, float(x)) for x in us]
        assert [g for g, (w, m) in zip(got, want) if m > 1e-6] == [w for w, m in want if m > 1e-6], r
        assert {g for g in got} <= {i for i, q in enumerate(probs) if q > 0}, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_kernel_cuts_a_broad_nucleus_inside_a_tie_of_signed_zeros(dtype):
    """A nucleus of hundreds of tokens (the kernel's radix sort, not its short-list qsort) whose top-p edge
    falls halfway through 1,200 tokens tied at zero, every other one -0.0, between positive and negative
    logits: the kernel keeps the lower ids of the tie whatever the zero's sign, as the plain-Python
    reference (which sorts by (-logit, id)), and draws its tokens across 400 values of u."""
    from kvserve.engine.sampler import sample_plain_rows
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(3000, generator=g)
    logits = -1.0 - 2.0 * torch.rand(3000, generator=g)  # the tail: (-3, -1]
    logits[ids[:200]] = 2.0
    zeros = ids[200:1400].sort().values
    logits[zeros] = torch.tensor([0.0, -0.0]).repeat(600)
    assert (torch.signbit(logits) & (logits == 0)).sum() == 600  # the premise: half the tie is -0.0
    logits = logits.to(dtype)
    mass = torch.exp(logits.double())
    top_p = float((mass[ids[:200]].sum() + 600.5) / mass.sum())  # the edge: mid-token, half through the tie
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = reference_probs(logits.float().tolist(), 1.0, 0, top_p, 0.0)
    kept = {i for i, q in enumerate(probs) if q > 0}
    assert kept == set(ids[:200].tolist()) | set(zeros[:601].tolist())  # the reference's own cut
    us = (torch.arange(400, dtype=torch.float64) + 0.5) / 400
    got = sample_plain_rows(logits[None], [0] * len(us), [params] * len(us), us)
    want = [inverse_cdf(probs, float(x)) for x in us]
    assert [t for t, (w, m) in zip(got, want) if m > 1e-6] == [w for w, m in want if m > 1e-6]
    assert set(got) <= kept and len(set(got) & set(zeros[300:601].tolist())) > 20


def test_sampler_draws_the_same_tokens_with_and_without_the_kernel(monkeypatch):
    """Seeded and unseeded temperature, top-k, top-p and min-p rows (one with a penalty: the processed
    logits) on bfloat16 logits: the Sampler on the kernel gives the tokens of its PyTorch path
    (sampling_probs + sample_from_probs) for the same seeds."""
    import kvserve.engine.sampler as sampler_mod
    _kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(7, 3000, generator=g).to(torch.bfloat16) * 2 for _ in range(8)]  # ties at the edges

    def run() -> list[list[int]]:
        gens = [torch.Generator().manual_seed(40 + i) for i in range(7)]
        torch.manual_seed(99)
        params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, min_p=0.02, seed=2),
                  SamplingParams(temperature=1.0), SamplingParams(top_p=0.9, seed=3),
                  SamplingParams(temperature=0.5, top_k=20, seed=4), SamplingParams(temperature=1.0, min_p=0.1),
                  SamplingParams(temperature=0.8, top_k=50, top_p=0.7, presence_penalty=0.5, seed=5)]
        rows = [SamplingRow(p, gens[i] if p.seed is not None else None, [], [1, 2, 3], ())
                for i, p in enumerate(params)]
        return [Sampler()(x, rows).token_ids for x in steps]

    with_kernel = run()
    monkeypatch.setattr(sampler_mod, "sampling_kernel", lambda logits: None)
    without = run()
    assert with_kernel == without
    assert len({t[0] for t in with_kernel}) > 1  # it really sampled


def test_sampling_kernel_leaves_nan_and_all_minus_inf_rows_to_the_torch_path():
    """A NaN row and an all -inf row beside a normal seeded row: those two get ids inside the vocabulary
    (the PyTorch path's answer), and the normal row draws what it draws alone."""
    _kernel_or_skip()
    normal = torch.randn(500, generator=torch.Generator().manual_seed(1))
    batch = torch.stack([torch.full((500,), float("nan")), normal, torch.full((500,), float("-inf"))])
    rows = [row(SamplingParams(temperature=1.0), seed=10), row(SamplingParams(temperature=1.0), seed=11),
            row(SamplingParams(temperature=1.0), seed=12)]
    ids = Sampler()(batch, rows).token_ids
    alone = Sampler()(normal[None], [row(SamplingParams(temperature=1.0), seed=11)]).token_ids
    assert all(0 <= i < 500 for i in ids)
    assert ids[1] == alone[0]


def test_sampling_kernel_infinite_logits_and_zero_tokens_at_the_edges(monkeypatch):
    """+inf logits (clamped to the float max, as torch's clamp_) share the mass equally; -inf tokens are
    never drawn, also at u = 0 and u just below 1, where rounding could reach the zeros around the live
    tokens (placed across the 256-token blocks)."""
    from kvserve.engine.sampler import sample_plain_rows
    _kernel_or_skip()
    logits = torch.full((1, 700), float("-inf"))
    logits[0, [3, 300, 310, 650]] = torch.tensor([-90.0, 2.0, -200.0, 3.0])  # 3 and 310: exp rounds to 0
    p = [SamplingParams(temperature=1.0)]
    assert sample_plain_rows(logits, [0], p, torch.tensor([0.0], dtype=torch.float64)) == [300]
    assert sample_plain_rows(logits, [0], p, torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)) == [650]
    inf = torch.zeros(1, 300)
    inf[0, [7, 299]] = float("inf")
    draws = sample_plain_rows(inf, [0] * 2000, p * 2000, torch.rand(2000, dtype=torch.float64))
    assert set(draws) == {7, 299}
    assert 850 < draws.count(7) < 1150  # binomial(2000, 1/2): mean 1000, sd 22


def test_sampling_kernel_cuts_ties_where_the_torch_path_does():
    """Edge cases from an adversarial review, each against sampling_probs's kept set over a grid of u:
    two tokens tied where the vector and one-by-one exp could round to opposite sides of a candidate
    floor (ids 1 and 8 of 9: the last is past the 8-lane groups), under top-k 2; two tokens tied at the
    top with top-p 0.5 and a tail below float32's rounding of the total (the PyTorch path keeps one: its
    float32 mass before the second is exactly 0.5); 100 tokens tied at the float max with top-p 0.5 (in
    float32, 50 × 0.01 rounds to 0.5 before the 51st: 50 kept; float64 sums keep 51)."""
    from kvserve.engine.sampler import sample_plain_rows
    _kernel_or_skip()
    split_tie = torch.full((1, 9), -30.0)
    split_tie[0, 0], split_tie[0, [1, 8]] = 0.0, -16.6355324
    top_tie = torch.tensor([[0.0, 0.0, -20.0, -20.0, -20.0]])
    flat_max = torch.zeros(1, 300)
    flat_max[0, 100:200] = float("inf")
    us = torch.cat([(torch.arange(200, dtype=torch.float64) + 0.5) / 200,
                    torch.tensor([1 - 1e-9, 1 - 1e-12], dtype=torch.float64)])
    for logits, params in [(split_tie, SamplingParams(top_k=2)), (top_tie, SamplingParams(top_p=0.5)),
                           (flat_max, SamplingParams(top_p=0.5))]:
        support = set((sampling_probs(logits.clone(), [params])[0] > 0).nonzero().flatten().tolist())
        got = sample_plain_rows(logits, [0] * len(us), [params] * len(us), us)
        assert set(got) <= support, (params, sorted(set(got)), sorted(support))
        if logits is split_tie:  # token 1 (e^-16.6 of the mass) at the top of the CDF, never 8
            assert got[-2:] == [1, 1] and support == {0, 1}
        else:  # every kept token is likely enough to be drawn on the grid
            assert set(got) == support and len(support) == (1 if logits is top_tie else 50)


# ------------------------------------------------------------------------------------ logprobs and penalty kernels
def _reference_logprobs(x: torch.Tensor, t: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """float64: log_softmax's value of token t, 1 + the tokens of a strictly greater logit, and the k tokens
    of largest logit in (logit descending, id ascending) order with their logprobs."""
    v = x.double()
    lp = torch.log_softmax(v, dim=-1)
    order = sorted(range(len(v)), key=lambda i: (-v[i].item(), i))[:k]
    return lp[t].item(), int((v > v[t]).sum()) + 1, order, [lp[i].item() for i in order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_kernel_matches_a_float64_reference(dtype):
    """kvs_token_logprobs (the sampler's logprobs on the CPU) against float64 log_softmax, rank and top-k
    by (logit descending, id ascending): rows around the 8-lane edges and of SmolLM2's 49,152 entries,
    heavy ties (rounded logits: torch's topk picked any of the tied tokens at the k-th place, the kernel
    the lowest ids), -inf entries and a -inf token, k from 0 to 64; one call for rows picked out of a
    batch. Logprobs within float32 rounding (2e-6 relative, 1e-6 absolute)."""
    from kvserve.engine.sampler import sampling_kernel, token_logprobs

    g = torch.Generator().manual_seed(11)
    cases = []
    for n in (1, 7, 8, 9, 17, 100, 49152):
        x = torch.randn(3, n, generator=g) * 4
        x[1] = x[1].round()  # ties
        x[2, ::3] = float("-inf")
        x[2, -1] = 0.0  # one finite entry at least
        cases.append(x.to(dtype))
    for x in cases:
        if sampling_kernel(x) is None:
            pytest.skip("no C compiler: the kernel path is not built here")
        n = x.shape[1]
        rows, tokens, ks = [2, 0, 1], [0, n // 2, n - 1], [min(64, n), 5 % (n + 1), 0]
        got = token_logprobs(x, tokens, ks, rows)
        for r, t, k, lp in zip(rows, tokens, ks, got):
            ref_lp, ref_rank, ref_ids, ref_top = _reference_logprobs(x[r].float(), t, k)
            assert lp.token_id == t and lp.rank == ref_rank and lp.top_token_ids == ref_ids, (n, r)
            if ref_lp == float("-inf"):
                assert lp.logprob == float("-inf")
            else:
                assert lp.logprob == pytest.approx(ref_lp, rel=2e-6, abs=1e-6), (n, r)
            assert lp.top_logprobs == pytest.approx(ref_top, rel=2e-6, abs=1e-6), (n, r)


def test_logprobs_kernel_leaves_nan_inf_and_all_minus_inf_rows_to_torch():
    """Rows the kernel returns (a NaN, +inf, only -inf) get PyTorch's log_softmax answers, the rows beside
    them the kernel's; a request for more than 64 alternatives (the kernel's most) takes PyTorch too."""
    from kvserve.engine.sampler import _torch_token_logprobs, sampling_kernel, token_logprobs

    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 300, generator=g)
    if sampling_kernel(x) is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    x[0, 17] = float("nan")
    x[1, 250] = float("inf")
    x[2] = float("-inf")
    got = token_logprobs(x, [3, 250, 5, 7], [3, 3, 3, 3])
    want = _torch_token_logprobs(x, [3, 250, 5, 7], [3, 3, 3, 3])
    for a, b in zip(got[:3], want[:3]):
        assert repr(a) == repr(b)  # NaN logprobs compare equal as text
    ref_lp, ref_rank, ref_ids, _ = _reference_logprobs(x[3], 7, 3)
    assert (got[3].rank, got[3].top_token_ids) == (ref_rank, ref_ids)
    many = token_logprobs(x[3:], [7], [65])[0]
    assert many.top_token_ids == _reference_logprobs(x[3], 7, 65)[2]
    # found by attacking it: more alternatives than the row has tokens returned stack garbage as ids, and
    # ids outside the row read past it (a segfault for 10**12); both take PyTorch's path, which raises
    small = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])
    for ids, rows, k in (([0], [0], 6), ([5], [0], 2), ([-1], [0], 2), ([10 ** 12], [0], 2), ([0], [1], 2)):
        with pytest.raises((RuntimeError, IndexError)):
            token_logprobs(small, ids, [k], rows)
    assert token_logprobs(small, [0], [5])[0].top_token_ids == [1, 2, 0, 3, 4]  # k = n: the kernel


def test_penalty_kernel_gives_the_torch_paths_float32_values(monkeypatch):
    """kvs_apply_penalties (only the seen tokens) against the PyTorch path over whole rows (the kernel
    turned off): the same float32 values bit for bit, for rows of repetition, presence and frequency
    penalties alone and together, repeated ids in prompt and output, a row without penalties between
    them, positive, negative, zero and NaN logits; ids outside the vocabulary still raise. The float32
    bits are compared as values (±0 alike)."""
    from kvserve.attention import kv_quant_kernel

    if kv_quant_kernel.load() is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    g = torch.Generator().manual_seed(13)
    vocab = 1000
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[:, :50] = logits[:, :50].round()  # zeros among the seen tokens
    logits[3, 7] = float("nan")
    ids = lambda m: torch.randint(0, 60, (m,), generator=g).tolist()  # repeats
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, presence_penalty=-1.1, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=1.7, frequency_penalty=2.0)]
    rows = [row(p, prompt=ids(40) + [7], output=ids(30) + [7]) for p in params]
    fast = apply_penalties(logits.clone(), rows)
    monkeypatch.setattr(kv_quant_kernel, "load", lambda: None)
    slow = apply_penalties(logits.clone(), rows)
    assert torch.equal(fast.isnan(), slow.isnan()) and fast.isnan().sum() == 1
    # equal values; only a -0.0 logit the penalties do not touch differs in sign: PyTorch's l - (-0.0)
    # over the whole row makes it +0.0
    assert torch.equal(fast.nan_to_num(0.0), slow.nan_to_num(0.0))
    assert not torch.equal(fast, logits)  # it did something
    monkeypatch.undo()
    with pytest.raises(RuntimeError):
        apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=1.3), output=[vocab + 5])])
