"""Multi-step decoding (``num_scheduler_steps``): several decode steps per engine step, run back to back
in the model runner. The oracle is the same engine one step at a time: each step of a burst is the same
C call on the same inputs, so tokens, texts, finish reasons and stop reasons must be identical, and the
KV blocks must all return to the pool."""
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata
from kvserve.config import ConfigError
from kvserve.engine.model_runner import advance_decode_inputs
from tests.conftest import tiny_llm


def _run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def _free_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.kv.pool.num_free_blocks


PROMPTS = [[5, 6, 7], list(range(100, 140)), list(range(300, 317))]


@pytest.mark.parametrize("steps", [2, 4, 7])
def test_bursts_give_the_tokens_of_single_steps_tiny(steps):
    """Greedy and seeded sampled rows side by side (the sampled draws come in the same order per row),
    max_tokens that are not multiples of the burst, so rows leave mid-burst and the burst shrinks."""
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=23, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=5, ignore_eos=True)]
    one, many = tiny_llm(), tiny_llm(num_scheduler_steps=steps)
    free = _free_blocks(many)
    a = _run(one, PROMPTS, params)
    s0 = many.engine.num_steps
    b = _run(many, PROMPTS, params)
    assert a == b
    assert [len(t[0]) for t in b] == [9, 23, 16]
    # the bursts ran: fewer engine steps than tokens (one step would need 23 decode steps for row 2)
    assert many.engine.num_steps - s0 < one.engine.num_steps
    assert _free_blocks(many) == free


def test_bursts_give_the_tokens_and_text_of_single_steps_on_the_bundled_model():
    """The bundled model in the fastest setup (int4 weights, bfloat16, int8 KV): an EOS inside a burst
    (' Paris.' ends after 3 tokens), 40-token runs, a batch of three."""
    kw = dict(dtype="bfloat16", weight_dtype="int4", kv_cache_dtype="int8", progress=False, max_model_len=512,
              kv_cache_memory="64MiB")
    one, many = LLM(**kw), LLM(num_scheduler_steps=8, **kw)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    sp = SamplingParams(max_tokens=40, temperature=0)
    free = _free_blocks(many)
    a, b = _run(one, prompts, sp), _run(many, prompts, sp)
    assert a == b
    # the EOS came inside a burst: the first token is the prompt step's, then bursts of 8
    assert a[0][2] == "stop" and len(a[0][0]) < 40 and (len(a[0][0]) - 1) % 8 != 0
    assert _free_blocks(many) == free
    # the anatomy's steps: bursts counted once, with all their tokens and bytes
    burst = [s for s in many.engine.step_stats if s.num_steps > 1]
    assert burst and all(s.num_tokens == s.num_seqs * s.num_steps for s in burst)
    assert all(s.weight_bytes >= s.num_steps * many.engine.weight_bytes_per_step for s in burst)


def test_stop_token_id_and_stop_string_inside_a_burst():
    one, many = tiny_llm(), tiny_llm(num_scheduler_steps=8)
    ref = _run(one, [[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    tokens, text = ref[0], ref[1]
    free = _free_blocks(many)
    for sp, stops in ((SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tokens[4]]), 5),
                      # the id before min_tokens does not stop: the row runs on (to its next one, or the end)
                      (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tokens[4]],
                                      min_tokens=6), None),
                      (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[text[len(text) // 3:][:3]]),
                       None)):
        a = _run(one, [[5, 6, 7]], sp)
        b = _run(many, [[5, 6, 7]], sp)
        assert a == b, sp
        if stops:
            assert a[0][2] == "stop" and len(a[0][0]) == stops
        else:
            assert len(a[0][0]) > 5
        assert _free_blocks(many) == free
    assert b[0][2] == "stop" and b[0][1] in text and len(b[0][1]) < len(text)  # the stop string's run


def test_burst_stops_at_max_model_len():
    one, many = tiny_llm(max_model_len=64), tiny_llm(max_model_len=64, num_scheduler_steps=16)
    prompt = list(range(200, 257))  # 57 tokens: 7 more fit
    sp = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)  # up to max_model_len
    a, b = _run(one, [prompt], sp), _run(many, [prompt], sp)
    assert a == b and len(a[0][0]) == 7 and a[0][2] == "length"


def test_rows_that_cannot_burst_fall_back_to_single_steps():
    """Logprobs and penalties need the PyTorch sampler between steps: such a row keeps one step per
    engine step (its lookahead slots unused), with the same tokens and logprobs as without bursts."""
    sp = [SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True)]
    one, many = tiny_llm(), tiny_llm(num_scheduler_steps=4)
    for p in sp:
        a = one.generate([[5, 6, 7]], p)[0].outputs[0]
        b = many.generate([[5, 6, 7]], p)[0].outputs[0]
        assert a.token_ids == b.token_ids
        if p.logprobs:
            assert [x.top_logprobs for x in a.logprobs] == [x.top_logprobs for x in b.logprobs]


def test_lookahead_slots_never_preempt_other_requests():
    """A pool that just fits 6 requests one step at a time: bursts take their slots ahead only while a
    block stays free for every later request, so they preempt no more than single steps do, and give
    the same tokens."""
    kw = dict(num_kv_blocks=14, block_size=16, enable_prefix_caching=False, max_model_len=64)
    one, many = tiny_llm(**kw), tiny_llm(num_scheduler_steps=8, **kw)
    prompts = [list(range(100 + 40 * i, 130 + 40 * i)) for i in range(6)]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    a, b = _run(one, prompts, sp), _run(many, prompts, sp)
    assert a == b
    assert many.engine.scheduler.num_preemptions <= one.engine.scheduler.num_preemptions
    assert _free_blocks(many) == _free_blocks(one)


def test_advance_decode_inputs_matches_metadata_built_for_the_next_step():
    """Oracle: ``AttentionMetadata.build`` for positions + 1, across a block boundary."""
    bs = 4
    tables = [[7, 2, 9], [3, 5, 0], [1, 8, 6]]
    ctx = [3, 7, 9]  # row 0 crosses into its second block, row 1 into its third
    meta = AttentionMetadata.build(tables, ctx, [1, 1, 1], bs)
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor(ctx)
    advance_decode_inputs(ids, pos, meta, [21, 22, 23])
    want = AttentionMetadata.build(tables, [c + 1 for c in ctx], [1, 1, 1], bs)
    assert ids.tolist() == [21, 22, 23] and pos.tolist() == [c + 1 for c in ctx]
    assert torch.equal(meta.slot_mapping, want.slot_mapping)
    assert meta.slot_mapping.tolist() == [2 * bs + 0, 0 * bs + 0, 6 * bs + 2]  # by hand
    assert torch.equal(meta.seq_lens, want.seq_lens) and meta.seq_lens_list == want.seq_lens_list
    assert torch.equal(meta.decode_mask, want.decode_mask)


@pytest.mark.parametrize("value", [0, 65, -1, 2.0, "4"])
def test_num_scheduler_steps_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        tiny_llm(num_scheduler_steps=value)


def test_num_scheduler_steps_with_speculative_decoding_is_refused():
    with pytest.raises(ConfigError, match="num_scheduler_steps must be 1 with speculative decoding"):
        tiny_llm(num_scheduler_steps=4, speculative_method="ngram")


@pytest.mark.parametrize("argv", [["bench", "spec"], ["eval", "ppl"]])
def test_commands_where_multi_step_cannot_apply_have_no_flag(argv, capsys):
    """bench spec always speculates, so it would always refuse the flag (a new-user trial found it in
    --help); eval ppl scores prompts and never decodes. The decoding commands keep it."""
    from kvserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi", "--num-scheduler-steps", "4"]).num_scheduler_steps == 4
    assert parser.parse_args(["bench", "latency", "--num-scheduler-steps", "4"]).num_scheduler_steps == 4
    with pytest.raises(SystemExit):
        parser.parse_args(argv + ["--num-scheduler-steps", "4"])
    assert "unrecognized arguments: --num-scheduler-steps" in capsys.readouterr().err
    assert parser.parse_args(argv).num_scheduler_steps == 1  # what build_llm passes the engine


def test_bench_latency_with_bursts_reports_per_pass_bytes_and_tpot(monkeypatch):
    """Bursts: MB/step is per forward pass (the single-step run's, the same tokens' KV), and the table
    compares TPOT (mean gap), the ITL p50 being ~0 inside bursts (hand-built report: 9.0 ms mean vs a
    10 ms peer = 0.90x)."""
    from kvserve.bench import latency
    from kvserve.bench.latency import ContextResult, LatencyReport, format_report

    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda n=1 << 30, repeats=5: 40e9)
    one = latency.run_context(tiny_llm(), 24, 17, 20e9)
    many = latency.run_context(tiny_llm(num_scheduler_steps=8), 24, 17, 20e9)
    assert many.decode_bytes_per_step == pytest.approx(one.decode_bytes_per_step, rel=1e-9)
    assert many.itl_p50_ms < many.itl_mean_ms  # most gaps are inside a burst
    rep = LatencyReport("m", "f", 20.0, peer="llama.cpp", num_scheduler_steps=8,
                        contexts=[ContextResult(128, 50.0, 9.0, 0.0, 30.0, 1e8, 12.5, 5.0, peer_ttft_ms=100.0,
                                                peer_itl_p50_ms=10.0)])
    text = format_report(rep)
    assert "8 steps per burst" in text and "TPOT" in text.splitlines()[3]
    assert text.splitlines()[4].split()[2] == "9.00" and "0.90x" in text


def test_anatomy_step_table_says_which_rows_are_bursts():
    from kvserve.metrics.report import _format_steps
    from kvserve.metrics.step_stats import StepStats

    def step(i, n):
        return StepStats(step=i, start_s=0.0, wall_s=0.004 * n, num_seqs=1, num_tokens=n, num_decode_tokens=n,
                         weight_bytes=100 * n, kv_bytes_read=10 * n, kv_bytes_per_token=10, num_steps=n)

    assert not any("burst" in line for line in _format_steps([step(1, 1), step(2, 1)], 10))
    one = "\n".join(_format_steps([step(1, 1), step(2, 8)], 10))
    assert "1 row is a multi-step burst" in one and "of up to 8 decode steps" in one
    assert "2 rows are multi-step bursts" in "\n".join(_format_steps([step(1, 3), step(2, 8)], 10))


def test_model_header_states_the_steps_per_engine_step():
    """generate's header (and serve's startup line, built by the same function) says when bursts may run."""
    from kvserve.cli import _multi_step_note, model_header

    assert "multi-step scheduling: up to 6 decode steps per engine step" in model_header(
        tiny_llm(num_scheduler_steps=6))
    assert "multi-step" not in model_header(tiny_llm())
    assert _multi_step_note(6, "; ") == "; multi-step scheduling: up to 6 decode steps per engine step"
    assert _multi_step_note(1, "; ") == ""


def test_stop_string_before_a_stop_token_in_the_same_burst():
    """Found by attacking it: a stop string completed at one token and a stop id (or EOS) later in the
    same burst ended the row at the id, keeping the tokens between and the id's stop_reason. The string
    came first, so it wins: the tokens end at its token, stop_reason is the string (as one step at a
    time, where the row never reached the id)."""
    one, many = tiny_llm(), tiny_llm(num_scheduler_steps=8)
    prompt = [5, 6, 7]
    toks = one.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    tok = one.engine.tokenizer
    stop = tok.decode(toks[:3])[len(tok.decode(toks[:2])):]  # the text token 3 adds
    assert stop and stop not in tok.decode(toks[:2])
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], stop_token_ids=[toks[5]])
    a, b = _run(one, [prompt], sp), _run(many, [prompt], sp)
    assert a == b
    assert a[0][0] == toks[:3] and a[0][2:] == ("stop", stop)


def test_a_request_that_stops_inside_a_burst_leaves_its_full_blocks_cached():
    """Found by attacking it: a request that stopped freed its blocks before its full ones were offered
    to the prefix cache, so a follow-up prompt (prompt + answer + more) hit fewer tokens with bursts.
    Hand-counted: 10 prompt + 15 output tokens, 4-token blocks: the 24 tokens of the first 6 blocks
    are cached (the 25th token's KV was never computed), whatever the burst length."""
    prompt = list(range(300, 310))
    ref = tiny_llm(block_size=4).generate([prompt], SamplingParams(max_tokens=30, temperature=0,
                                                                   ignore_eos=True))[0].outputs[0].token_ids
    for steps in (1, 8):
        llm = tiny_llm(block_size=4, num_scheduler_steps=steps)
        kv = llm.engine.kv_manager
        first = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[ref[14]]))[0].outputs[0]
        assert first.token_ids == ref[:15]
        hits = kv.num_hit_tokens
        llm.generate([prompt + first.token_ids + [7, 8, 9]], SamplingParams(max_tokens=4, temperature=0))
        assert kv.num_hit_tokens - hits == 24, steps


def test_no_lookahead_in_steps_that_cannot_burst():
    """Found by attacking it: slots held ahead in a step mixing a prefill chunk with a decode (which runs
    one step) took the blocks the prefill's next chunk needed and preempted it. Lookahead now comes
    only to a step of decodes alone, with nothing waiting: the same preemptions (none) as one step at a
    time."""
    kw = dict(num_kv_blocks=20, block_size=4, enable_prefix_caching=False, max_model_len=80,
              max_num_batched_tokens=8)
    a, b = [5, 6, 7], list(range(100, 140))
    ref = tiny_llm(**kw).generate([a], SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    sp = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop_token_ids=[ref[8]]),
          SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    base = tiny_llm(**kw)
    want = _run(base, [a, b], sp)
    for steps in (8, 64):
        llm = tiny_llm(num_scheduler_steps=steps, **kw)
        assert _run(llm, [a, b], sp) == want
        assert llm.engine.scheduler.num_preemptions == base.engine.scheduler.num_preemptions == 0
        assert _free_blocks(llm) == 20


def test_sliding_window_model_runs_single_steps_and_says_so(caplog):
    """Gemma-3's sliding-window layers have no one-call decode plan, so no bursts: the engine warns at
    start, holds no slots ahead, and runs exactly the single-step schedule."""
    import logging

    kw = dict(load_format="dummy", progress=False, max_model_len=64, num_kv_blocks=104, block_size=4,
              enable_prefix_caching=False)
    prompts = [list(range(100 + 30 * i, 125 + 30 * i)) for i in range(3)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    one = LLM("tiny-gemma3", **kw)
    with caplog.at_level(logging.WARNING):
        many = LLM("tiny-gemma3", num_scheduler_steps=8, **kw)
    assert "num_scheduler_steps=8 has no effect" in caplog.text
    assert _run(one, prompts, sp) == _run(many, prompts, sp)
    assert many.engine.num_steps == one.engine.num_steps
    assert many.engine.scheduler.num_preemptions == one.engine.scheduler.num_preemptions


def test_model_without_the_one_call_path_warns_that_bursts_never_run(caplog):
    """bfloat16 dense matrices have a decode plan but no one C call with the LM head (found by attacking
    it: no warning, and the bench header still said "8 steps per burst")."""
    import logging

    with caplog.at_level(logging.WARNING):
        llm = tiny_llm(dtype="bfloat16", weight_dtype="bfloat16", num_scheduler_steps=4)
    assert "num_scheduler_steps=4 has no effect" in caplog.text
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert llm.engine.num_steps == 10 and all(s.num_steps == 1 for s in llm.engine.step_stats)


def test_bench_latency_reports_single_steps_where_bursts_never_run(monkeypatch):
    """A bfloat16 dense model never bursts: the report must not claim "4 steps per burst" nor swap its
    ITL p50 column for TPOT."""
    from kvserve.bench import latency

    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda n=1 << 30, repeats=5: 40e9)
    never = latency.run_latency_bench(tiny_llm(dtype="bfloat16", weight_dtype="bfloat16", num_scheduler_steps=4),
                                      [16], 4, [], 8, 2)
    runs = latency.run_latency_bench(tiny_llm(num_scheduler_steps=4), [16], 4, [], 8, 2)
    assert never.num_scheduler_steps == 1 and "per burst" not in latency.format_report(never)
    assert runs.num_scheduler_steps == 4 and "4 steps per burst" in latency.format_report(runs)
