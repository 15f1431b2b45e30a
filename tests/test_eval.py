"""``kvserve eval ppl`` on the tiny random-weight model: the corpus ships with Python, perplexity is
exp(-mean logprob) of the engine's prompt logprobs, chunked prefill gives the same logprobs as a whole
prefill (float32: 1e-4; quantized: same tolerance, since every query reads the dequantized cache), and
the CLI prints both perplexities and the teacher-forced |Δ logprob|."""
import json
import math

import pytest

from kvserve.eval.ppl import compare, corpus_text, perplexity, window_logprobs, windows
from tests.conftest import tiny_llm
from tests.test_cli import TINY, kvserve


def test_corpus_ships_with_python():
    text = corpus_text()
    assert len(text) > 100_000 and "assert" in text


def test_windows_are_consecutive_and_checked():
    assert windows(list(range(10)), 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows([1, 2], 4, 1)


@pytest.mark.parametrize("kind", ["float32", "int8", "fp8_e4m3"])
def test_chunked_logprobs_equal_whole_prefill(kind):
    llm = tiny_llm(kv_cache_dtype=kind, enable_prefix_caching=False)
    ids = windows(llm.tokenizer.encode(corpus_text())[:400], 96, 2)
    whole = window_logprobs(llm, ids)
    chunked = window_logprobs(tiny_llm(kv_cache_dtype=kind, enable_prefix_caching=False,
                                       max_num_batched_tokens=32), ids)
    assert len(whole[0]) == 95
    assert max(abs(a - b) for wa, wb in zip(whole, chunked) for a, b in zip(wa, wb)) < 1e-4
    r = perplexity(llm, kind, ids)
    flat = [x for w in r.logprobs for x in w]
    assert r.num_scored_tokens == 190 and math.isclose(r.ppl, math.exp(-sum(flat) / len(flat)))


def test_compare_reports_deltas():
    llm = tiny_llm(enable_prefix_caching=False)
    ids = windows(llm.tokenizer.encode(corpus_text())[:200], 64, 1)
    c = compare(perplexity(llm, "float32", ids), perplexity(llm, "float32", ids))
    assert c.mean_abs_delta == 0 and c.max_abs_delta == 0


def test_cli_eval_ppl_compare(tmp_path):
    out = tmp_path / "ppl.json"
    r = kvserve("eval", "ppl", *TINY, "--context", "64", "--kv-cache-dtype", "int8", "--compare-kv-dtype", "float32",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "kv_cache_dtype=int8: perplexity" in r.stdout and "kv_cache_dtype=float32: perplexity" in r.stdout
    assert "teacher-forced |Δ logprob| (int8 vs float32): mean" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["test"]["num_scored_tokens"] == 63 and 0 < rep["mean_abs_delta"] <= rep["max_abs_delta"]


def test_cli_eval_ppl_compare_weight_dtype(tmp_path):
    out = tmp_path / "ppl.json"
    r = kvserve("eval", "ppl", *TINY, "--context", "64", "--weight-dtype", "int4", "--compare-weight-dtype", "float32",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "weight_dtype=int4 kv_cache_dtype=auto: perplexity" in r.stdout
    assert "(auto KV, int4 weights vs auto KV, float32 weights)" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["test"]["weight_dtype"] == "int4" and rep["reference"]["weight_dtype"] == "float32"
    assert rep["test"]["ppl"] != rep["reference"]["ppl"] and 0 < rep["mean_abs_delta"] <= rep["max_abs_delta"]


def test_cli_kv_cache_dtype_in_header_and_errors():
    r = kvserve("generate", "Hello", *TINY, "--max-tokens", "3", "--ignore-eos", "--raw", "--kv-cache-dtype", "fp8_e4m3")
    assert r.returncode == 0, r.stderr
    assert "KV cache fp8_e4m3: 160 B/token (incl. float32 scales)" in r.stderr  # K,V x 2 layers x 2 heads x (16 + 4)
    r = kvserve("generate", "Hello", *TINY, "--kv-cache-dtype", "fp4")
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr


def test_cli_eval_ppl_kv_pool_error_names_context():
    """eval ppl sets max_model_len to --context + 1, so a KV pool too small for it advised lowering a
    max_model_len the user never gave. 64 KiB is 8 blocks of 16 tokens for tiny-llama in float32
    (2 layers x K and V x 16 tokens x 2 heads x 16 dims x 4 B = 8 KiB a block); 1,025 tokens need 65."""
    import contextlib
    import io

    from kvserve.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["eval", "ppl", *TINY, "--context", "1024", "--kv-cache-memory", "64KiB"]) == 2
    assert "8 blocks" in err.getvalue() and "give at least 65 blocks" in err.getvalue()
    assert err.getvalue().rstrip().endswith("(here max_model_len is --context + 1: lower --context)")
