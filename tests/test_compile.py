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
