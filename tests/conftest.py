import pytest

from kvserve import LLM


def tiny_llm(**kw) -> LLM:
    """A 2-layer random-weight Llama (GQA 4/2 heads) with the SmolLM2 tokenizer."""
    kw.setdefault("max_model_len", 512)
    return LLM("tiny-llama", load_format="dummy", progress=False, **kw)


@pytest.fixture(scope="session")
def tiny():
    return tiny_llm()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled real model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32)."""
    return LLM("smollm2-135m", progress=False)
