"""Bad and edge-case input to the offline API: each gets a clear error naming the field, nothing is
lost (other requests keep running, KV blocks return to the pool) and the engine stays usable."""
import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.sampling_params import InvalidRequestError
from tests.conftest import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def assert_idle(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.num_kv_blocks


def test_child_request_id_collision_is_rejected_and_engine_survives(tiny):
    eng = tiny.engine
    eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=3, n=2))  # sequences "b-0", "b-1"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("b-0", [1, 2, 3], SamplingParams(max_tokens=3))
    assert e.value.param == "request_id"
    eng.add_request("c-1", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        eng.add_request("c", [1, 2], SamplingParams(max_tokens=2, n=2))  # would create "c-1" again
    finished = set()
    while eng.has_unfinished_requests():
        finished |= {o.request_id for o in eng.step() if o.finished}
    assert finished == {"b", "c-1"}
    assert_idle(tiny)


@pytest.mark.parametrize("bad", [None, {"max_tokens": 1}, "x"])
def test_sampling_params_of_wrong_type(tiny, bad):
    with pytest.raises(InvalidRequestError) as e:
        tiny.engine.add_request("wrong-type", [1, 2], bad)
    assert e.value.param == "sampling_params"
    calls = [lambda: tiny.generate(["a"], [bad])] + ([lambda: tiny.generate(["a"], bad)] if bad else [])
    for call in calls:  # sampling_params=None means the defaults
        with pytest.raises(InvalidRequestError) as e:
            call()
        assert e.value.param == "sampling_params"
    assert_idle(tiny)


def test_bad_prompt_in_a_batch_aborts_the_ones_queued_before_it(tiny):
    for prompts in (["fine", ""], ["fine", 5], [[1, 2], [-1]]):
        with pytest.raises(InvalidRequestError):
            tiny.generate(prompts, GREEDY)
        assert_idle(tiny)
    with pytest.raises(InvalidRequestError):
        tiny.chat([[{"role": "user", "content": "a"}], [{"role": "user"}]], GREEDY)
    assert_idle(tiny)


def test_interleaved_streams_lose_nothing(tiny):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [tiny.generate(p, sp)[0].outputs[0] for p in ("hello", "world")]
    a, b = tiny.stream("hello", sp), tiny.stream("world", sp)
    outs_a, outs_b = [next(a)], [next(b)]
    outs_a += list(a)
    outs_b += list(b)
    for outs, ref in zip((outs_a, outs_b), alone):
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == ref.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == ref.text
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert_idle(tiny)


def test_generate_during_a_stream_keeps_the_stream_whole(tiny):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = tiny.generate("hello", sp)[0].outputs[0]
    s = tiny.stream("hello", sp)
    outs = [next(s)]
    tiny.generate(["x", "y"], SamplingParams(max_tokens=3))
    outs += list(s)
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == ref.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == ref.text
    assert_idle(tiny)


def test_abandoned_stream_frees_its_blocks(tiny):
    s = tiny.stream("hello there", SamplingParams(max_tokens=50))
    next(s)
    assert tiny.engine.kv_manager.num_free_blocks < tiny.engine.num_kv_blocks
    del s
    assert_idle(tiny)


@pytest.mark.parametrize("prompts", [None, 5, 1.5])
def test_generate_rejects_non_prompts(tiny, prompts):
    with pytest.raises(InvalidRequestError) as e:
        tiny.generate(prompts)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": None, "content": "hi"}],
                                      [{"role": 5, "content": "hi"}], [{"role": "", "content": "hi"}]])
def test_chat_rejects_bad_messages(tiny, messages):
    with pytest.raises(InvalidRequestError) as e:
        tiny.chat(messages, GREEDY)
    assert e.value.param.startswith("messages")
    assert_idle(tiny)


def test_chat_renders_developer_as_system(tiny):
    """OpenAI's newer name for the system role: the Python API prefills what the server does (an
    adversarial review: 40 tokens here, SmolLM2's default system prompt plus a literal developer turn,
    against 18 over the server)."""
    conv = [{"role": "user", "content": "hi"}]
    dev = tiny.encode_chat([{"role": "developer", "content": "Be brief."}] + conv)
    assert dev == tiny.encode_chat([{"role": "system", "content": "Be brief."}] + conv)
    assert "developer" not in dev[0]


@pytest.mark.parametrize("kwargs", [[("a", 1)], {"messages": []}, {"tokenize": True}, {"add_generation_prompt": 0},
                                    {"self": 1}, {1: "x"}])
def test_chat_template_kwargs_that_clash_name_the_field(tiny, kwargs):
    """Not a mapping, a non-string key, or one of apply_chat_template's own arguments or variables: an
    InvalidRequestError naming chat_template_kwargs before anything is queued."""
    with pytest.raises(InvalidRequestError) as e:
        tiny.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template_kwargs=kwargs)
    assert e.value.param == "chat_template_kwargs"
    assert_idle(tiny)


def test_chat_template_kwargs_reach_the_template_in_python(tiny, monkeypatch):
    """LLM.chat and apply_chat_template pass chat_template_kwargs to the template as Hugging Face's
    apply_chat_template does (a template that reads one, put on the tokenizer for this test)."""
    from tests.test_server_validation import GREETING_TEMPLATE
    monkeypatch.setattr(tiny.tokenizer, "chat_template", GREETING_TEMPLATE)
    conv = [{"role": "user", "content": "hi"}]
    want = tiny.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, greeting="yo")
    assert want.endswith("[yo]<assistant>")  # the oracle's premise
    assert tiny.apply_chat_template(conv, chat_template_kwargs={"greeting": "yo"}) == want
    out = tiny.chat(conv, GREEDY, chat_template_kwargs={"greeting": "yo"})[0]
    assert out.prompt == want and out.prompt_token_ids == tiny.tokenizer.encode(want, add_special_tokens=False)
    assert "[yo]" not in tiny.apply_chat_template(conv)
    # a template that fails: the variables' fault where the messages render without them, else the
    # messages' (the server's 400s name the same fields)
    monkeypatch.setattr(tiny.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                                        "{% if greeting %}{{ greeting.upper() }}{% endif %}")
    for bad in ({"greeting": 5}, {"greeting": [[[[]]]], "deep": [[]] * 3}):
        with pytest.raises(InvalidRequestError) as e:
            tiny.chat(conv, GREEDY, chat_template_kwargs=bad)
        assert e.value.param == "chat_template_kwargs", bad
    monkeypatch.setattr(tiny.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate") as e:
        tiny.apply_chat_template(conv, chat_template_kwargs={"greeting": "yo"})
    assert e.value.param == "messages"
    assert_idle(tiny)


def test_chat_template_replaces_the_models(tmp_path):
    """LLM(chat_template=...) (vLLM's --chat-template): a file or the template's text replaces the model's,
    and chat renders what Hugging Face's apply_chat_template renders with that template; a path that is
    not there, an unreadable file or broken Jinja is a ConfigError naming chat_template, before loading."""
    from kvserve.llm import load_chat_template
    template = ("{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}"
                "{% if add_generation_prompt %}<go>{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    conv = [{"role": "user", "content": "hi"}]
    assert load_chat_template(template) == load_chat_template(str(path)) == template
    llm = tiny_llm(chat_template=str(path))
    want = llm.tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert want == "<user|hi><go>"  # the oracle's premise
    out = llm.chat(conv, GREEDY)[0]
    assert out.prompt == want and out.prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe{{")
    for bad, needle in ((str(tmp_path / "missing.jinja"), "not a file"), ("{% for %}", "parse"),
                        (str(tmp_path / "bad.jinja"), "cannot read"), ("", "file or a Jinja")):
        with pytest.raises(ConfigError, match=needle) as e:
            load_chat_template(bad)
        assert "chat_template" in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("ignore_eos", "no"), ("ignore_eos", None), ("include_stop_str_in_output", 1),
    ("skip_special_tokens", "false"), ("stop", 123), ("stop", {"a": 1}), ("stop_token_ids", 5),
    ("stop_token_ids", "ab"), ("seed", 2**70)])
def test_sampling_params_wrong_types_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_huge_top_k_is_off(tiny):
    sp = dict(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    huge = tiny.generate("hi", SamplingParams(top_k=10**30, **sp))[0].outputs[0].token_ids
    assert huge == tiny.generate("hi", SamplingParams(top_k=0, **sp))[0].outputs[0].token_ids


@pytest.mark.parametrize("kw", [dict(temperature=5e-324), dict(temperature=1e-300),
                                dict(temperature=1.0, repetition_penalty=1e-300),
                                dict(temperature=1.0, repetition_penalty=math.inf),
                                dict(temperature=1.0, repetition_penalty=1e300)])
def test_extreme_temperature_and_penalty_never_sample_nan(tiny, kw):
    prompt = list(range(100, 164))
    out = tiny.generate([prompt], SamplingParams(max_tokens=8, seed=0, **kw))[0].outputs[0]
    # a NaN distribution makes argmax pick token 0 (an EOS of this tokenizer) at once
    assert len(out.token_ids) == 8 and 0 not in out.token_ids, out.token_ids


def test_tiny_temperature_is_greedy(tiny):
    greedy = tiny.generate("hi", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    tiny_t = tiny.generate("hi", SamplingParams(temperature=1e-7, seed=1, max_tokens=6, ignore_eos=True))[0]
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.mark.parametrize("kw,field", [
    (dict(block_size=16.0), "block_size"), (dict(block_size="16"), "block_size"),
    (dict(num_kv_blocks=1.5), "num_kv_blocks"), (dict(max_num_seqs="4"), "max_num_seqs"),
    (dict(max_num_batched_tokens=None), "max_num_batched_tokens"), (dict(max_model_len=1.5), "max_model_len"),
    (dict(kv_cache_memory=1.5), "kv_cache_memory"), (dict(kv_cache_memory=10**30), "kv_cache_memory"),
    (dict(num_kv_blocks=10**12), "num_kv_blocks: 1000000000000 blocks .*lower --num-kv-blocks"),
    (dict(seed="x"), "seed"), (dict(seed=2**70), "seed"),
    (dict(num_threads=-1), "num_threads"),
    (dict(num_threads=100_000), r"num_threads must be in \[0, 1024\]")])  # torch segfaulted on it
def test_engine_settings_of_wrong_type_or_size(kw, field):
    with pytest.raises(ConfigError, match=field):
        tiny_llm(**kw)
    with pytest.raises(ConfigError, match="model"):
        LLM(None, progress=False)


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 100, b"GGUF\x03\x00\x00\x00garbage"])
def test_corrupt_gguf_is_a_config_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    for load_format in ("auto", "dummy"):
        with pytest.raises(ConfigError, match="bad.gguf"):
            LLM(str(path), load_format=load_format, progress=False)


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(tmp_path), progress=False)


@pytest.mark.parametrize("args", [["--output-tokens", "1"], ["--concurrency", "0"],
                                  ["--concurrency-output-tokens", "0"], ["--contexts", "-5"]])
def test_bench_latency_rejects_sizes_it_cannot_measure(args, capsys):
    from kvserve.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "latency", *args])
    assert e.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_weights_larger_than_memory_are_a_config_error():
    """llama-3-70b in float32 (~280 GB) must not reach the OOM killer."""
    from kvserve import LLM
    from kvserve.config import ConfigError

    with pytest.raises(ConfigError, match="GiB"):
        LLM("llama-3-70b", load_format="dummy", progress=False)
