"""``--compile``: the compiled decoder layers give the eager layers' tokens and logprobs
(float32, tiny random model, prefill + batched decode), and a second sequence length does not break it."""
import pytest

from kvserve import SamplingParams
from tests.conftest import tiny_llm


@pytest.mark.slow
def test_compiled_layers_match_eager():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[5, 9, 100, 7, 11], list(range(30, 67))]
    eager = tiny_llm().generate(prompts, params)
    compiled = tiny_llm(compile=True).generate(prompts, params)
    for e, c in zip(eager, compiled):
        assert e.outputs[0].token_ids == c.outputs[0].token_ids
        for le, lc in zip(e.outputs[0].logprobs, c.outputs[0].logprobs):
            assert abs(le.logprob - lc.logprob) < 1e-4


@pytest.mark.slow
def test_compiled_layers_with_packed_weights_prefill_through_the_dense_copy():
    """int4 weights: prompts of >= dense_min_tokens rows multiply with the dense copy, which compile
    must be able to trace (the prepacked oneDNN layout is turned back into a plain tensor); where the
    int4 kernel has AMX there is no copy, and from int4_gemm_min_rows() rows its GEMM runs eagerly."""
    from kvserve.models.quant import DENSE_MIN_TOKENS, int4_gemm_min_rows

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 5 + max(DENSE_MIN_TOKENS, int4_gemm_min_rows() or 0) + 2)), [5, 6, 7]]
    eager = tiny_llm(dtype="bfloat16", weight_dtype="int4").generate(prompts, params)
    compiled = tiny_llm(dtype="bfloat16", weight_dtype="int4", compile=True).generate(prompts, params)
    for e, c in zip(eager, compiled):
        assert len(c.outputs[0].token_ids) == 3
        assert e.outputs[0].token_ids[0] == c.outputs[0].token_ids[0]


@pytest.mark.slow
def test_compiled_layers_prefill_a_long_chunk_after_context():
    """A prefill chunk of SPLIT_MIN_QUERIES or more tokens after earlier context: eager code attends in two
    mask-free calls of the CPU flash op, which Inductor cannot lower (it raised a LoweringException), so
    compiled layers take the masked call. Tokens and logprobs as eager's."""
    from kvserve.attention.paged import SPLIT_MIN_QUERIES

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [(i * 7919) % 40000 + 100 for i in range(2 * SPLIT_MIN_QUERIES + 76)]  # chunks 512, 512, 76
    kw = dict(max_num_batched_tokens=SPLIT_MIN_QUERIES, max_model_len=2048, enable_prefix_caching=False)
    eager = tiny_llm(**kw).generate([prompt], params)[0].outputs[0]
    compiled = tiny_llm(compile=True, **kw).generate([prompt], params)[0].outputs[0]
    assert eager.token_ids == compiled.token_ids
    for le, lc in zip(eager.logprobs, compiled.logprobs):
        assert abs(le.logprob - lc.logprob) < 1e-4
