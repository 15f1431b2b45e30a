"""The bundled SmolLM2 against HF transformers loading the same GGUF (the independent oracle).

Float32 logits at every prompt position within 2e-3 absolute (both dequantize the same Q4_1/Q8_0
blocks; differences come from matmul ordering only), and greedy generation of 64 tokens
token-identical with HF's own ``generate`` (its own KV cache) for 20 prompts.
"""
import os

import pytest
import torch

from kvserve import SamplingParams
from kvserve.attention import AttentionMetadata

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\n", "Water boils at", "1, 1, 2, 3, 5, 8,",
    "The mitochondria is", "Translate to French: Good morning", "List of planets: Mercury, Venus,",
    "In 1969, Neil Armstrong", "The best way to learn programming is", "SELECT * FROM users WHERE",
    "Photosynthesis converts", "The Pythagorean theorem states", "My favourite food is",
    "Q: What is 12 times 12?\nA:", "The Eiffel Tower", "Machine learning is a field", "Roses are red,",
]


@pytest.fixture(scope="module")
def hf_model(smollm2):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = smollm2.engine.config.model
    from kvserve.models.catalog import catalog_path

    gguf = catalog_path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), torch_dtype=torch.float32)
    return model.eval()


def _kvserve_logits(llm, ids):
    eng = llm.engine
    bs = eng.kv_spec.block_size
    table = list(range(-(-len(ids) // bs)))  # engine idle: borrow the first blocks
    meta = AttentionMetadata.build([table], [0], [len(ids)], bs)
    with torch.inference_mode():
        hidden = eng.model(torch.tensor(ids), torch.arange(len(ids)), eng.runner.kv_caches, meta)
        return eng.model.compute_logits(hidden)


@pytest.mark.parametrize("prompt", PROMPTS[:5])
def test_logits_match_hf(smollm2, hf_model, prompt):
    ids = smollm2.tokenizer.encode(prompt)
    ours = _kvserve_logits(smollm2, ids)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < 2e-3, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_identical_to_hf_generate(smollm2, hf_model):
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = smollm2.generate(PROMPTS, sp)  # one continuous batch
    import copy

    # no EOS at all, like ignore_eos (HF's min_new_tokens would instead forbid EOS and change tokens);
    # HF merges the model's own generation_config, so EOS must be removed there
    gen_config = copy.deepcopy(hf_model.generation_config)
    gen_config.update(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf_model.generation_config.eos_token_id = None
    # all 20 in one HF batch, left-padded with an attention mask (HF's batched generate; one prompt at a
    # time took 65-95 s of the suite's time, batched ~9 s, with the same tokens)
    enc = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    with torch.inference_mode():
        ref = hf_model.generate(ids, attention_mask=mask, generation_config=gen_config)[:, width:].tolist()
    mismatches = [p for p, out, r in zip(PROMPTS, ours, ref) if out.outputs[0].token_ids != r]
    assert not mismatches, mismatches
