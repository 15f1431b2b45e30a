"""FAILURE-KINDS 12 (fp8 KV cache runs away) on the bundled SmolLM2: 10 chat prompts, greedy. With an
fp8_e4m3 / int8 KV cache the answers whose float32 answer stops (EOS) also stop (at most
ALLOWED_RUNAWAYS of 10 run to max_tokens: greedy paths diverge, and a 135M model then gives a
different answer of a different length), and never loop where float32 does not;
and float32's own answers, teacher-forced through each cache, keep mean |Δ logprob| under MEAN_DELTA."""
import pytest

from kvserve import LLM, SamplingParams
from kvserve.eval.ppl import window_logprobs

PROMPTS = ["What is the capital of France?", "Give me three tips for sleeping better.",
           "Explain what a hash table is in two sentences.", "Write a haiku about autumn.",
           "What is 12 times 7?", "Name the planets of the solar system.",
           "How do I boil an egg?", "Translate 'good morning' into Spanish.",
           "What does a CPU do?", "Summarize the plot of Romeo and Juliet in one sentence."]
MAX_TOKENS = 160
# Teacher-forced mean |Δ logprob| of float32's 10 answers (1,001 tokens), measured: int8 0.0129,
# fp8_e4m3 0.0287, fp8_e5m2 0.0625 (max 0.19 / 0.36 / 2.1). Thresholds: ~2x the measured mean.
MEAN_DELTA = {"int8": 0.03, "fp8_e4m3": 0.06, "fp8_e5m2": 0.12}
# Answers that stop (EOS) in float32 but run to max_tokens with the quantized cache, out of 10. Greedy
# paths diverge early with 1-byte caches (3 of 10 answers token-identical for fp8_e4m3), after which a
# 135M model's answer length is a coin toss (e.g. 113 -> 31, 56 -> 149 tokens), so a path may ramble.
# Measured: int8 0; fp8_e4m3 0 or 1 depending on float32 rounding at the last bit (which answer
# diverges where changed when the fused RMSNorm/SiLU kernels changed float32 summation order).
ALLOWED_RUNAWAYS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 0}  # e5m2: xfail, see below
CONVS = [[{"role": "user", "content": p}] for p in PROMPTS]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _loops(ids: list[int], tail: int = 48) -> bool:
    """True when the last ``tail`` tokens are one short pattern (period ≤ 12) repeated."""
    t = ids[-tail:]
    return len(t) == tail and any(all(t[i] == t[i % p] for i in range(tail)) for p in range(1, 13))


@pytest.fixture(scope="module")
def reference():
    """float32 answers, the prompt+answer token ids, and their float32 teacher-forced logprobs."""
    llm = LLM(progress=False, max_model_len=1024, weight_dtype="float32")
    outs = llm.chat(CONVS, GREEDY)
    full = [llm.encode_chat(c)[1] + o.outputs[0].token_ids for c, o in zip(CONVS, outs)]
    prompt_lens = [len(llm.encode_chat(c)[1]) for c in CONVS]
    return outs, full, prompt_lens, window_logprobs(llm, full)


def _mean_abs_delta(lp_q, lp_f, prompt_lens) -> tuple[float, float]:
    d = [abs(a - b) for wa, wb, n in zip(lp_q, lp_f, prompt_lens) for a, b in zip(wa[n - 1:], wb[n - 1:])]
    return sum(d) / len(d), max(d)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8", pytest.param("fp8_e5m2", marks=pytest.mark.xfail(
    reason="2 mantissa bits: on SmolLM2-135M 1-2 of the 10 answers degenerate and run (nearly) to max_tokens "
           "(ppl +4.8% at 2k); use fp8_e4m3 or int8", strict=False))])
def test_12_quantized_cache_stops_where_full_precision_stops(reference, kind):
    ref_outs, full, prompt_lens, lp_f = reference
    llm = LLM(progress=False, max_model_len=1024, kv_cache_dtype=kind, weight_dtype="float32")
    mean, worst = _mean_abs_delta(window_logprobs(llm, full), lp_f, prompt_lens)
    print(f"\n{kind}: teacher-forced mean |Δ logprob| {mean:.4f}, max {worst:.3f}")
    assert mean < MEAN_DELTA[kind]
    outs = llm.chat(CONVS, GREEDY)
    same = sum(r.outputs[0].token_ids == o.outputs[0].token_ids for r, o in zip(ref_outs, outs))
    print(f"{kind}: {same}/10 answers token-identical to float32; lengths "
          f"{[(len(r.outputs[0].token_ids), len(o.outputs[0].token_ids)) for r, o in zip(ref_outs, outs)]}")
    runaways = []
    for r, o in zip(ref_outs, outs):
        rc, oc = r.outputs[0], o.outputs[0]
        if not _loops(rc.token_ids):  # the 135M model itself loops on some prompts in float32
            assert not _loops(oc.token_ids), oc.text
        if rc.finish_reason == "stop" and oc.finish_reason != "stop":
            runaways.append((rc.text, oc.text))
    assert len(runaways) <= ALLOWED_RUNAWAYS[kind], (kind, runaways)


@pytest.mark.slow
def test_12_int8_cache_on_the_fast_path_keeps_int4_answers():
    """The fastest setup (int4 matrices, bfloat16, int8 KV: the decode plan's one C call with codes and
    scales) against the same model with a bfloat16 cache: the bf16 answers, teacher-forced through the
    int8 cache, keep mean |Δ logprob| under ~2x the measured 0.026-0.030 (5 or 10 answers; more than
    float32's 0.013: the bf16 model's own roundings, and prefill attends in float32 over the dequantized
    cache where the bf16 cache attends in bf16); greedy answers never loop where the bf16 ones do not, and
    at most one of the 5 runs to max_tokens where the bf16 one stops. Measured: 2 of these 5
    token-identical with prefill on oneDNN's bf16 copy of the weights, 1 with kvserve's int4 GEMM (the
    same bf16 weights, float32 sums in another order); with the GEMM the int8 cache's egg recipe
    (coherent, not looping) ran past 160 tokens where the bf16 cache's stopped at 114: as in
    ALLOWED_RUNAWAYS above, once greedy paths part a 135M model's answer length is a coin toss."""
    kw = dict(progress=False, max_model_len=1024, weight_dtype="int4", dtype="bfloat16")
    convs = CONVS[::2]  # 5 of the 10: the suite's time budget
    ref_llm = LLM(kv_cache_dtype="bfloat16", **kw)
    ref_outs = ref_llm.chat(convs, GREEDY)
    full = [ref_llm.encode_chat(c)[1] + o.outputs[0].token_ids for c, o in zip(convs, ref_outs)]
    prompt_lens = [len(ref_llm.encode_chat(c)[1]) for c in convs]
    lp_ref = window_logprobs(ref_llm, full)
    del ref_llm
    llm = LLM(kv_cache_dtype="int8", **kw)
    mean, worst = _mean_abs_delta(window_logprobs(llm, full), lp_ref, prompt_lens)
    print(f"\nint4 + int8 KV: teacher-forced mean |Δ logprob| {mean:.4f}, max {worst:.3f}")
    assert mean < 0.06
    outs = llm.chat(convs, GREEDY)
    same = sum(r.outputs[0].token_ids == o.outputs[0].token_ids for r, o in zip(ref_outs, outs))
    print(f"int4 + int8 KV: {same}/{len(convs)} answers token-identical to the bf16 cache's")
    runaways = []
    for r, o in zip(ref_outs, outs):
        rc, oc = r.outputs[0], o.outputs[0]
        if not _loops(rc.token_ids):
            assert not _loops(oc.token_ids), oc.text
        if rc.finish_reason == "stop" and oc.finish_reason != "stop":
            runaways.append((rc.text, oc.text))
    assert len(runaways) <= 1, runaways
