"""Engine behaviour on a tiny random-weight model: batch invariance, seeds, n, preemption, abort,
chunked prefill, finish reasons, max_tokens edges, anatomy and step statistics."""
import pytest
import torch

from kvserve import InvalidRequestError, SamplingParams
from tests.conftest import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Hello", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
           "Paris is the capital of", "A" * 40, "def f(x):\n    return", "日本語のテキスト", "🙂 emoji"]


def _ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_greedy_alone_equals_inside_mixed_batch(tiny):
    alone = [tiny.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    mixed = [GREEDY, GREEDY, GREEDY,
             SamplingParams(temperature=0.8, max_tokens=10, seed=1), SamplingParams(temperature=1.0, max_tokens=30),
             SamplingParams(temperature=0, max_tokens=5, n=2), SamplingParams(top_p=0.5, max_tokens=17),
             SamplingParams(temperature=0.7, top_k=5, max_tokens=3)]
    outs = tiny.generate(PROMPTS, mixed)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone


def test_seeded_sample_independent_of_batch(tiny):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tiny.generate("Once upon a time", sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True) for _ in range(5)]
    outs = tiny.generate(["x y z", "Once upon a time", "abc", "q", "long " * 20, "z"], others[:1] + [sp] + others[1:])
    assert outs[1].outputs[0].token_ids == alone
    again = tiny.generate("Once upon a time", sp)[0].outputs[0].token_ids
    assert again == alone
    different = tiny.generate("Once upon a time", sp.clone(seed=99))[0].outputs[0].token_ids
    assert different != alone


def test_n_choices_indexed_and_greedy_identical(tiny):
    out = tiny.generate("Hello there", SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = [c.token_ids for c in tiny.generate("Hello there", sp)[0].outputs]
    b = [c.token_ids for c in tiny.generate("Hello there", sp)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_preemption_gives_identical_tokens_and_frees_pool():
    prompts = [f"request number {i} " + "word " * (10 + 7 * i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in range(7)]
    params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2))
    ample = tiny_llm(max_model_len=256)
    ref = _ids(ample.generate(prompts, params))
    small = tiny_llm(max_model_len=256, num_kv_blocks=18, block_size=16)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert _ids(got) == ref
    for o in got:
        for c in o.outputs:
            assert len(c.token_ids) == 40 and c.finish_reason == "length"
    assert small.engine.kv_manager.num_free_blocks == small.engine.num_kv_blocks


def test_chunked_prefill_matches_whole_prefill():
    prompt = "chunk " * 100
    whole = tiny_llm(max_num_batched_tokens=2048).generate(prompt, GREEDY)[0].outputs[0].token_ids
    chunked_llm = tiny_llm(max_num_batched_tokens=16)
    out = chunked_llm.generate([prompt, "short one"], GREEDY)
    assert out[0].outputs[0].token_ids == whole
    assert max(s.num_tokens for s in chunked_llm.engine.step_stats) <= 16


def test_abort_returns_blocks(tiny):
    eng = tiny.engine
    free0 = eng.kv_manager.num_free_blocks
    rid = tiny.add("abort me " * 30, SamplingParams(max_tokens=100, ignore_eos=True, n=2))
    for _ in range(3):
        eng.step()
    assert eng.kv_manager.num_free_blocks < free0
    out = eng.abort_request(rid)
    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert eng.kv_manager.num_free_blocks == free0
    assert not eng.has_unfinished_requests()


def test_max_tokens_edges(tiny):
    zero = tiny.generate("hi", SamplingParams(max_tokens=0))[0].outputs[0]
    assert zero.token_ids == [] and zero.text == "" and zero.finish_reason == "length"
    one = tiny.generate("hi", SamplingParams(max_tokens=1, ignore_eos=True))[0].outputs[0]
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    n_prompt = len(tiny.tokenizer.encode("hi"))
    with pytest.raises(InvalidRequestError) as e:
        tiny.generate("hi", SamplingParams(max_tokens=512))
    assert e.value.param == "max_tokens" and "512" in str(e.value) and str(n_prompt) in str(e.value)
    # max_tokens=None means "up to the context length"
    full = tiny_llm(max_model_len=40).generate("hi", SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(full.token_ids) == 40 - n_prompt and full.finish_reason == "length"
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)


def test_bad_prompts_raise_named_errors(tiny):
    with pytest.raises(InvalidRequestError) as e:
        tiny.generate("", SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        tiny.generate([[5, 49152]], SamplingParams())
    assert e.value.param == "prompt" and "49152" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        tiny.generate([[1] * 600], SamplingParams(max_tokens=1))
    assert "600" in str(e.value) and "512" in str(e.value)
    assert tiny.generate("still alive", SamplingParams(max_tokens=2))[0].finished


def test_stop_lists_are_bounded():
    """At the bounds a request is taken; one past them is an error naming the field and the bound."""
    from kvserve.sampling_params import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

    assert (MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS) == (32, 1000, 1000)  # the README's figures
    SamplingParams(stop=["x" * 1000] * 32, stop_token_ids=list(range(1000)))
    for kw, param, needles in [({"stop": ["a"] * 33}, "stop", ("32", "33")),
                               ({"stop": ["a" * 1001]}, "stop", ("1000", "1001")),
                               ({"stop_token_ids": [7] * 1001}, "stop_token_ids", ("1000", "1001"))]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param and all(n in str(e.value) for n in needles), str(e.value)


def test_stop_token_id_and_stop_string_finish_reasons(tiny):
    base = tiny.generate("Stop here", GREEDY)[0].outputs[0]
    k = 6
    tok = base.token_ids[k]
    first = base.token_ids.index(tok)
    out = tiny.generate("Stop here", GREEDY.clone(stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == base.token_ids[:first + 1]
    # stop string spanning >= 2 tokens, derived from the greedy text
    text = base.text
    prefix = tiny.tokenizer.decode(base.token_ids[:3], skip_special_tokens=True)
    span = tiny.tokenizer.decode(base.token_ids[3:6], skip_special_tokens=True)
    i = text.find(span)
    stop = text[i:i + len(span)]
    assert len(prefix) >= 0 and stop
    out = tiny.generate("Stop here", GREEDY.clone(stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:i]
    streamed = "".join(o.outputs[0].delta_text for o in tiny.stream("Stop here", GREEDY.clone(stop=[stop])))
    assert streamed == text[:i]


def test_latency_anatomy_adds_up(tiny):
    out = tiny.generate("Time me", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    lat = out.latency
    assert lat.num_output_tokens == 12 and len(lat.itl_ms) == 11
    finishing = lat.e2e_ms - (lat.ttft_ms + sum(lat.itl_ms))
    assert 0 <= finishing < 500, finishing  # a few clock reads; generous for a loaded machine
    assert lat.tpot_ms == pytest.approx((lat.e2e_ms - lat.ttft_ms) / 11)
    assert lat.ttft_ms >= lat.tokenize_ms + lat.queue_ms
    assert min(lat.itl_ms) > 0


def test_step_stats_bytes(tiny):
    eng = tiny.engine
    cfg = eng.model_config
    # K and V, 2 layers, 2 KV heads, head_dim 16, float32: hand-computed
    assert eng.kv_spec.bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    n_prompt = len(tiny.tokenizer.encode("count my bytes"))
    eng.step_stats.clear()
    tiny.generate("count my bytes", SamplingParams(max_tokens=4, ignore_eos=True))
    steps = list(eng.step_stats)
    assert [s.num_tokens for s in steps] == [n_prompt, 1, 1, 1]
    assert [s.kv_bytes_read for s in steps] == [512 * (n_prompt + i) for i in range(4)]
    # untied: the LM head is streamed every step, the embedding table only for the looked-up row
    params_bytes = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) * 4
    assert steps[1].weight_bytes == params_bytes + cfg.hidden_size * 4
    assert all(s.achieved_bytes_per_s > 0 for s in steps)


def test_prompt_logprobs_match_a_full_forward_even_when_chunked(tiny):
    """prompt_logprobs over a prompt prefilled in chunks equal log_softmax of one full forward pass
    (the oracle) scored against each next prompt token; the first entry is None."""
    import torch

    from tests.test_hf_parity import _kvserve_logits

    ids = tiny.tokenizer.encode("one two three four five six seven eight nine ten " * 3)
    ref = torch.log_softmax(_kvserve_logits(tiny, ids), -1)
    chunked = tiny_llm(max_num_batched_tokens=8)
    out = chunked.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True))[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for pos in range(1, len(ids)):
        assert lps[pos].token_id == ids[pos]
        assert abs(lps[pos].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert lps[pos].top_token_ids[0] == int(ref[pos - 1].argmax())


def test_forked_child_generates_instead_of_hanging(tiny):
    """After generate, a fork's child used to hang in its first multi-threaded OpenMP region (libgomp
    keeps the parent's pool record, not its threads). The child now runs on one thread and gives the
    parent's greedy tokens; the parent kills it if it is not done in 60 s."""
    import os
    import time

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = tiny.generate(["fork me"], sp)[0].outputs[0].token_ids
    threads = torch.get_num_threads()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its tokens through the pipe, never return into pytest
        try:
            got = tiny.generate(["fork me"], sp)[0].outputs[0].token_ids
            os.write(w, ",".join(map(str, got)).encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline, done = time.monotonic() + 60, False
    while not done and time.monotonic() < deadline:
        done = os.waitpid(pid, os.WNOHANG)[0] == pid
        time.sleep(0.2)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    out = os.read(r, 4096).decode()
    os.close(r)
    assert out, "the forked child hung or died"
    assert [int(t) for t in out.split(",")] == want
    assert torch.get_num_threads() == threads  # the parent keeps its threads


def test_one_token_prompt_chunks_count_as_prompt_tokens():
    """A prompt chunk of one token (a 1-token prompt, or the last chunk of a chunked prefill) is prefill:
    prompt tokens summed over the steps equal the prompts' lengths (oracle: the prompts themselves)."""
    llm = tiny_llm(enable_prefix_caching=False, max_num_batched_tokens=16)
    prompts = [list(range(100, 117)), [42]]  # 17 tokens: chunks of 16 and 1; a 1-token prompt
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert sum(s.num_prefill_tokens for s in llm.engine.step_stats) == sum(len(o.prompt_token_ids) for o in outs) == 18


def test_one_token_steps_reuse_input_tensors_holding_the_general_paths_values():
    """Steps whose every row has one query token write their inputs into tensors kept from the last such
    step (ModelRunner._prepare_one_token). Oracle: the general path (AttentionMetadata.build and a fresh
    tensor) on the same step, compared field by field before the next step overwrites them. The batch
    covers rows joining and leaving (requests of different lengths and max_tokens), block tables growing
    past block boundaries, a one-token prompt alone (prefill: all_decoding False) and chunked prefills;
    the tokens are those of a run with the reuse turned off."""
    llm = tiny_llm(enable_prefix_caching=False, max_num_batched_tokens=16)
    runner = llm.engine.runner
    assert runner.reuse_decode_inputs
    prompts = [[42], list(range(100, 117)), list(range(3, 18)), list(range(5, 37)), list(range(7, 9))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 3, 20, 9, 60)]
    orig, checked, buffers = runner._prepare, [], set()

    def check(sched):
        got = orig(sched)
        if runner.reuse_decode_inputs and all(s.num_scheduled_tokens == 1 for s in sched.scheduled):
            saved = [t.clone() for t in (got[0], got[1], got[2].slot_mapping, got[2].block_tables,
                                         got[2].seq_lens, got[2].query_start_loc)]
            runner.reuse_decode_inputs = False
            try:
                ref = orig(sched)
            finally:
                runner.reuse_decode_inputs = True
            want = [ref[0], ref[1], ref[2].slot_mapping, ref[2].block_tables, ref[2].seq_lens, ref[2].query_start_loc]
            assert all(torch.equal(a, b) for a, b in zip(saved, want)), "one-token inputs differ from the general path"
            for f in ("seq_lens_list", "query_lens_list", "num_decodes", "block_size", "sliding_window",
                      "all_decoding"):
                assert getattr(got[2], f) == getattr(ref[2], f), f
            assert (got[2].decode_mask is None) == (ref[2].decode_mask is None)
            if ref[2].decode_mask is not None:
                assert torch.equal(got[2].decode_mask, ref[2].decode_mask)
            assert got[3] is got[2]
            checked.append((len(sched.scheduled), got[2].block_tables.shape[1], got[2].all_decoding))
            buffers.add(got[0].data_ptr())
        return got

    runner._prepare = check
    alone = llm.generate([[42]], params[0])[0].outputs[0].token_ids  # its prefill: one row of one token
    reused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner._prepare = orig
    assert {c[0] for c in checked} >= {1, 2, 3, 4}  # rows joining and leaving
    assert len({c[1] for c in checked}) >= 3  # tables of several widths
    assert any(not c[2] for c in checked) and any(c[2] for c in checked)
    assert len(buffers) < len(checked) / 2  # most steps reused the tensors of the step before
    runner.reuse_decode_inputs = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reused
    assert llm.generate([[42]], params[0])[0].outputs[0].token_ids == alone


def test_kv_cache_must_fit_beside_the_weights(monkeypatch):
    """The KV pool is checked together with the weights as held, not alone. Oracle, by hand for
    tiny-llama in float32: 6,365,504 parameters × 4 B, its RoPE cos and sin tables (2,048 × 8 float32
    each) and 64 KV blocks of 2 layers × K and V × 16 tokens × 32 dims × 4 B."""
    from kvserve import memory
    from kvserve.config import ConfigError

    total = 6_365_504 * 4 + 2 * 2048 * 8 * 4 + 64 * (2 * 2 * 16 * 32 * 4)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: total)
    assert tiny_llm(num_kv_blocks=64).engine.num_kv_blocks == 64  # exactly enough
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: total - 1)
    with pytest.raises(ConfigError, match=r"num_kv_blocks: 64 blocks x 8192 B = 0\.5 MiB beside the weights' "
                                          r"24\.4 MiB exceeds this machine's memory"):
        tiny_llm(num_kv_blocks=64)
    # a container's memory limit below the machine's memory is what the kernel enforces: it counts
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: 64 << 30)
    monkeypatch.setattr(memory, "cgroup_memory_limit_bytes", lambda: total - 1)
    with pytest.raises(ConfigError, match=r"exceeds the cgroup memory limit \(24\.9 MiB\)"):
        tiny_llm(num_kv_blocks=64)
    monkeypatch.setattr(memory, "cgroup_memory_limit_bytes", lambda: total)
    assert tiny_llm(num_kv_blocks=64).engine.num_kv_blocks == 64


@pytest.mark.parametrize("files, limit", [
    ({"memory.max": "max\n"}, None),  # cgroup v2 without a limit
    ({"memory.max": "1073741824\n"}, 1 << 30),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1: 2**63 to a page, no limit
    ({"memory/memory.limit_in_bytes": "2147483648\n"}, 2 << 30),
    ({"memory.max": "0\n"}, None), ({"memory.max": "-1\n"}, None),  # not limits a kernel writes: ignored
    ({"memory.max": b"\xff\xfe"}, None),  # not text
    ({}, None),  # no cgroup files at all
])
def test_cgroup_memory_limit_is_read_from_either_cgroup_version(tmp_path, monkeypatch, files, limit):
    from kvserve import memory

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    assert memory.cgroup_memory_limit_bytes(str(tmp_path)) == limit
    physical = memory.physical_memory_bytes()
    monkeypatch.setattr(memory, "cgroup_memory_limit_bytes", lambda: limit)
    assert memory.memory_limit_bytes() == (physical if limit is None else min(physical, limit))


@pytest.mark.parametrize("proc_line, files, limit", [
    # v2: the group itself says "max", its parent holds it to 1 GiB
    ("0::/a/b\n", {"cg/a/b/memory.max": "max\n", "cg/a/memory.max": "1073741824\n"}, 1 << 30),
    # v2: the lowest of group, parent and the root's file wins, wherever it is
    ("0::/a/b\n", {"cg/a/b/memory.max": "3221225472\n", "cg/a/memory.max": "max\n",
                   "cg/memory.max": "2147483648\n"}, 2 << 30),
    # v1: the same walk under memory/
    ("4:memory:/x/y\n0::/\n", {"cg/memory/x/y/memory.limit_in_bytes": "9223372036854771712\n",
                                "cg/memory/x/memory.limit_in_bytes": "536870912\n"}, 1 << 29),
    # a path that climbs out of the root is not followed: the limit beside the root is not read
    ("0::/../outside\n", {"cg/memory.max": "max\n", "outside/memory.max": "1024\n"}, None),
    # nor is a group of the same name inside the root: "/../b" is outside this namespace, not "b"
    ("0::/../b\n", {"cg/memory.max": "max\n", "cg/b/memory.max": "1024\n"}, None),
    # a malformed line before the v2 line does not stop the parse
    ("garbage\n0::/a\n", {"cg/a/memory.max": "1073741824\n"}, 1 << 30),
], ids=["v2-parent", "v2-lowest", "v1-parent", "no-escape", "outside-namespace", "malformed-line"])
def test_cgroup_memory_limit_counts_the_ancestors_limits(tmp_path, proc_line, files, limit):
    from kvserve import memory

    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert memory.cgroup_memory_limit_bytes(str(tmp_path / "cg"), str(proc)) == limit
