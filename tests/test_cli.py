"""The CLI as a user runs it (a subprocess): generate streams text then prints the anatomy; chat
answers on stdin; bench latency prints its tables; bad flags give a clear error, not a traceback."""
import contextlib
import json
import subprocess
import sys

import pytest

TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--max-model-len", "512"]


def kvserve(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def run_main(capsys, *args) -> tuple[int, str]:
    """kvserve's CLI in this process (no interpreter and torch start per call, ~5 s each here): the exit
    code (argparse's SystemExit too) and what it wrote to stderr. An uncaught exception fails the test,
    as a traceback in a subprocess's stderr would."""
    import kvserve.cli as cli

    capsys.readouterr()
    try:
        rc = cli.main(list(args))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_generate_streams_then_prints_anatomy():
    r = kvserve("generate", "Hello there", *TINY, "--max-tokens", "12", "--ignore-eos", "--raw")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the generated text
    for label in ("tokenize", "queue", "prefill", "TTFT", "decode", "TPOT", "E2E", "per decode step", "GB/s"):
        assert label in r.stderr, label
    assert "11 tokens x mean ITL" in r.stderr  # 12 tokens -> 11 inter-token gaps


def test_anatomy_of_a_request_without_output_times_no_first_token():
    """--max-tokens 0 finishes without a step; its anatomy said "TTFT 0.00 ms" and put tokenize and queue
    under "finishing". Hand-made breakdown: 9.5 ms tokenize, 0.25 ms queue, 10 ms E2E."""
    from kvserve.metrics.report import format_anatomy
    from kvserve.outputs import LatencyBreakdown

    lat = LatencyBreakdown(tokenize_ms=9.5, queue_ms=0.25, ttft_ms=0.0, itl_ms=[], tpot_ms=0.0, e2e_ms=10.0,
                           detokenize_ms=0.0, prefill_ms=0.0, decode_ms=0.0, num_prompt_tokens=31,
                           num_output_tokens=0)
    text = format_anatomy(lat, [])
    assert "TTFT" in text and "(no token)" in text and "0.00 ms" not in text.split("TTFT")[1].split("\n")[0]
    assert "= tokenize + queue + 0.25 ms finishing" in text and "not run: 0 output tokens" in text


def test_generate_bad_input_is_a_clear_error(capsys):
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--temperature", "-1")
    assert rc == 2 and "temperature" in err
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--max-tokens", "100000")
    assert rc == 2 and "--max-tokens" in err and "512" in err
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--kv-cache-memory", "64KiB")
    assert rc == 2 and "max_model_len=512" in err


def test_sampling_flags_are_checked_before_the_model_loads(monkeypatch, capsys):
    """A bad sampling flag was reported only after the model had loaded (~8 s for the bundled one), as
    ``error [--temperature]: --temperature must ...``: now at once, the flag named once."""
    import kvserve.cli as cli

    def never(*_):
        raise AssertionError("the model was built before the sampling flags were checked")

    monkeypatch.setattr(cli, "build_llm", never)
    for command in (["generate", "hi"], ["chat"]):
        assert cli.main([*command, *TINY, "--temperature", "-1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvserve: error: --temperature must be in [0") and err.count("temperature") == 1, err
    assert cli.main(["generate", "hi", *TINY, "--top-k", "-3"]) == 2
    assert "error: --top-k must be -1 or 0 (off) or >= 1, got -3" in capsys.readouterr().err
    assert cli.main(["generate", "hi", *TINY, "--stop-token-id", "-4"]) == 2  # a flag that does not spell it
    assert "error: --stop-token-id must be non-negative integers, got -4" in capsys.readouterr().err


def test_bench_spec_runs_the_draft_model_it_is_given(monkeypatch):
    """bench spec fills in the method when none is given: it chose ngram even beside --draft-model, and
    the engine then refused 'speculative_method ngram', a value the user never typed."""
    import kvserve.cli as cli

    class Built(Exception):
        pass

    def build(a, *_, **__):
        raise Built(a.speculative_method)

    monkeypatch.setattr(cli, "build_llm", build)
    for extra, method in (([], "ngram"), (["--draft-model", "tiny-llama"], "draft"),
                          (["--speculative-method", "ngram"], "ngram")):
        with pytest.raises(Built) as e:
            cli.main(["bench", "spec", *TINY, *extra])
        assert e.value.args == (method,), extra


def test_bench_spec_samples_when_asked(monkeypatch, capsys):
    """bench spec measured greedy requests only; --temperature/--top-p/--min-p/--seed now reach both runs'
    SamplingParams (the plain run's opts out of speculation), the title says so, and a bad value is an
    error naming its flag before the model loads."""
    import kvserve.bench.spec as spec_mod
    import kvserve.cli as cli

    seen, real = [], spec_mod.run_workload

    def run(llm, name, prompts, max_tokens, k, params=None):
        seen.append(params)
        return real(llm, name, prompts[:1], max_tokens, k, params)

    monkeypatch.setattr(spec_mod, "run_workload", run)
    assert cli.main(["bench", "spec", *TINY, "--output-tokens", "6", "--temperature", "0.8", "--top-p", "0.9",
                     "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert "batch 1, temperature 0.8, top-p 0.9, seed 4" in out, out
    assert [(p.temperature, p.top_p, p.seed, p.min_p) for p in seen] == [(0.8, 0.9, 4, 0.0)] * 2

    def unbuilt(a, *_, **__):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(cli, "build_llm", unbuilt)
    assert cli.main(["bench", "spec", *TINY, "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err


def test_cli_errors_name_the_flags_not_the_settings(capsys):
    """Errors are raised with the Python API's setting names; the CLI writes a message's subject as the
    flag a user types (a new-user trial met ``draft_model`` for ``--draft-model``). Only the subject:
    further on, names can be parts of paths, quoted values or a draft's settings (an adversarial review
    found '/tmp/--max-model-len/--block-size.gguf' and the target's flags in a draft's error), and
    one-word names are English words or another flag's."""
    from kvserve.cli import as_flags

    flags = {"block_size": "--block-size", "draft_model": "--draft-model", "model": "--model",
             "max_model_len": "--max-model-len", "num_kv_blocks": "--num-kv-blocks",
             "enable_prefix_caching": "--no-prefix-caching"}
    assert as_flags("block_size must be a positive power of two, got 0", flags) == \
        "--block-size must be a positive power of two, got 0"
    assert as_flags("num_kv_blocks: 1 block of 16 tokens; lower max_model_len", flags) == \
        "--num-kv-blocks: 1 block of 16 tokens; lower max_model_len"
    assert as_flags("max_model_len (9) exceeds the model's context length", flags) == \
        "--max-model-len (9) exceeds the model's context length"
    # a setting whose flag has another name: LLM(num_threads=...) is --threads
    assert as_flags("num_threads must be >= 0 (0 = torch's default), got -1", {**flags, "num_threads": "--threads"}) \
        == "--threads must be >= 0 (0 = torch's default), got -1"
    for kept in ("GGUF file not found: '/tmp/max_model_len/block_size.gguf'",  # a path
                 "unknown model 'draft_model': give a .gguf path",  # a quoted value
                 "model.num_heads (3) must be a multiple of model.num_kv_heads (2)",  # one word, then '.'
                 "model 'x' is a gguf model, but load_format='safetensors'",  # one-word subject
                 "block_sizes stay", "max_model_len.json is missing",  # not the name itself
                 "enable_prefix_caching needs ...",  # its flag does not spell it
                 "prompt (31 tokens) + max_tokens (100000) exceeds max_model_len"):  # not the subject
        assert as_flags(kept, flags) == kept
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--speculative-method", "draft")
    assert rc == 2 and "--speculative-method 'draft' needs draft_model (--draft-model" in err, err
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--block-size", "0")
    assert rc == 2 and "--block-size must be" in err, err
    # the pool sized by --num-kv-blocks is named so (it said kv_cache_memory, which was not given)
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--num-kv-blocks", "1")
    assert rc == 2 and "--num-kv-blocks: 1 block of 16 tokens" in err, err
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--draft-model", "tiny-llama")
    assert rc == 2 and "and no speculative_method was given" in err, err  # it said "None"
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--speculative-method", "draft", "--draft-model",
                       "/no/max_model_len.gguf")
    assert rc == 2 and "--draft-model: GGUF file not found: '/no/max_model_len.gguf'" in err, err
    rc, err = run_main(capsys, "serve", *TINY, "--port", "99999")  # refused before the model loads (it was a
    assert rc == 2 and "a port is 1-65535, got 99999" in err  # uvicorn traceback)
    # the pool named by the flag that sized it, in the memory check too (it said lower --kv-cache-memory)
    rc, err = run_main(capsys, "generate", "hi", *TINY, "--num-kv-blocks", "1000000000")
    assert rc == 2 and "--num-kv-blocks: 1000000000 blocks" in err and "lower --num-kv-blocks" in err, err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "0"], "a port is 1-65535, got 0"),  # the banner said :0, not the port bound
    (["eval", "ppl", "--context", "0"], "must be >= 2, got 0"),  # a ZeroDivisionError after the load
    (["eval", "ppl", "--num-windows", "0"], "must be >= 1, got 0"),  # "fewer than one window", untrue
    (["bench", "prefix", "--num-requests", "0"], "must be >= 1, got 0"),  # an IndexError
])
def test_sizes_refused_before_the_model_loads(argv, message, capsys):
    from kvserve.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err

def test_chat_reads_stdin():
    r = kvserve("chat", *TINY, "--max-tokens", "5", "--ignore-eos", stdin="Hi\nAnd again\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("TTFT") == 2


def test_bench_latency_tables(tmp_path):
    out = tmp_path / "r.json"
    r = kvserve("bench", "latency", *TINY, "--contexts", "32,64", "--output-tokens", "4", "--concurrency", "1,2",
                "--json", str(out), "--kv-cache-dtype", "fp8_e4m3", "--weight-dtype", "int4")
    assert r.returncode == 0, r.stderr
    assert "plain read bandwidth" in r.stdout and "concurrency" in r.stdout
    assert "(float32; matrices: 9 int4; KV fp8_e4m3; " in r.stdout  # what ran (2 layers x 4 + LM head), by flag names
    data = json.loads(out.read_text())
    n = data["threads"]
    # the run's thread count ("1 thread" singular), then the sampling
    assert n >= 1 and f"; {n} thread{'s' if n != 1 else ''}; greedy)" in r.stdout
    assert data["temperature"] == 0.0
    assert [c["context_tokens"] for c in data["contexts"]] == [32, 64]
    assert data["contexts"][1]["decode_bytes_per_step"] > data["contexts"][0]["decode_bytes_per_step"]
    assert [t["concurrency"] for t in data["throughput"]] == [1, 2]


@pytest.mark.slow
def test_generate_with_bundled_model_answers():
    r = kvserve("generate", "What is the capital of France? Answer in one word.", "--max-tokens", "20")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "finish_reason=stop" in r.stderr


def test_bench_compare_llamacpp_without_the_extra_is_a_clear_error(monkeypatch, capsys):
    """llama-cpp-python is optional (the 'bench' extra): without it the flag fails before any benchmarking."""
    import importlib.util

    from kvserve.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    rc = main(["bench", "latency", "--model", "smollm2-135m", "--contexts", "32", "--compare", "llama.cpp"])
    err = capsys.readouterr().err
    assert rc != 0 and "llama-cpp-python" in err and "make setup-bench" in err


def test_bench_compare_hf_without_accelerate_is_a_clear_error(monkeypatch, capsys):
    """HF's GGUF loading needs accelerate (the 'hf' and 'test' extras): without it the flag fails at once,
    naming the package and the make target that installs it."""
    import importlib.util

    from kvserve.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    rc = main(["bench", "latency", "--model", "smollm2-135m", "--contexts", "32", "--compare", "hf"])
    err = capsys.readouterr().err
    assert rc != 0 and "accelerate" in err and "make setup-test" in err


@pytest.mark.parametrize("peer", ["hf", "llama.cpp"])
def test_bench_compare_on_dummy_weights_fails_before_benchmarking(peer, capsys, monkeypatch):
    from kvserve.bench import latency
    from kvserve.cli import main

    monkeypatch.setattr(latency, "run_latency_bench", lambda *a, **k: pytest.fail("benchmark ran"))
    rc = main(["bench", "latency", *TINY, "--contexts", "32", "--compare", peer])
    assert rc != 0 and f"--compare {peer} needs real weights" in capsys.readouterr().err


def test_bench_peer_columns_are_ratios_of_the_same_run():
    from kvserve.bench.latency import ContextResult, LatencyReport, format_report

    rep = LatencyReport("m", "bfloat16", 20.0, peer="llama.cpp",
                        contexts=[ContextResult(128, 50.0, 9.0, 8.0, 10.0, 1e8, 12.5, 5.0, peer_ttft_ms=100.0,
                                                peer_itl_p50_ms=10.0)])
    text = format_report(rep)
    assert "kvserve ÷ llama.cpp" in text and "0.50x" in text and "0.80x" in text


def test_bench_concurrency_roofline_streams_decode_bytes_and_keeps_prefill_time():
    """Hand-computed: a prefill step (measured 0.5 s) + two decode steps of 100 MB each at 20 GB/s
    (5 ms each) = 0.51 s; 16 × 128 tokens / 0.51 s."""
    from kvserve.bench.latency import LatencyReport, ThroughputResult, format_report, roofline_seconds
    from kvserve.metrics.step_stats import StepStats

    def step(i, wall, tokens, decode_tokens, weight_bytes):
        return StepStats(i, 0.0, wall, 16, tokens, decode_tokens, weight_bytes, 0, 0)

    steps = [step(1, 0.5, 2048, 0, 80e6), step(2, 0.02, 16, 16, 60e6), step(3, 0.03, 16, 16, 100e6)]
    steps[1].kv_bytes_read = 40e6
    assert abs(roofline_seconds(steps, 20e9) - 0.51) < 1e-12
    rep = LatencyReport("m", "f", 20.0, throughput=[ThroughputResult(1, 256, 128, 1.0, 128.0, 1, 1, 256.0),
                                                    ThroughputResult(16, 256, 128, 4.0, 512.0, 1, 1, 1024.0)])
    row = format_report(rep).splitlines()[-1]
    assert row.split()[5] == "4.00x" and row.split()[-2:] == ["1024.0", "4.00x"]
    # the ratios are against the concurrency-1 run wherever it is, and absent without one
    rep.throughput.reverse()
    assert format_report(rep).splitlines()[-2].split()[5] == "4.00x"
    rep.throughput = rep.throughput[:1]
    row = format_report(rep).splitlines()[-1]
    assert "x" not in row.replace("ms", "") and row.split()[5] == "-" and row.split()[-1] == "-"


def test_bench_kv_slope_is_extra_bytes_over_extra_time():
    from kvserve.bench.latency import ContextResult, LatencyReport, kv_slope_gb_per_s

    rows = [ContextResult(128, 1, 10.0, 10.0, 10, 100e6, 1, 1), ContextResult(4096, 1, 15.0, 14.0, 15, 180e6, 1, 1)]
    assert abs(kv_slope_gb_per_s(LatencyReport("m", "f", 20.0, contexts=rows)) - 20.0) < 1e-9  # 80 MB / 4 ms
    assert kv_slope_gb_per_s(LatencyReport("m", "f", 20.0, contexts=rows[:1])) is None


@pytest.mark.parametrize("env,expected", [({}, "2000 ACTIVE"), ({"GOMP_SPINCOUNT": "5"}, "5 None"),
                                          ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
                                          ({"KVSERVE_OMP_DEFAULTS": "1"}, "None None")])
def test_import_sets_a_short_openmp_spin_unless_the_user_chose(env, expected):
    """libgomp's default spin made decode ~18x slower with one of 2 cores busy; kvserve shortens it (and
    sets the ACTIVE policy, whose throttled spin keeps a non-main engine thread's barriers from sleeping)
    unless the user set a wait policy or a spin count (or asked for libgomp's defaults)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVSERVE_OMP_DEFAULTS")}
    code = "import os, kvserve; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code],
                         env={**base, **env}, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


def test_chat_template_flag(capsys, tmp_path):
    """--chat-template (vLLM's flag) gives generate the template to render; a value that is neither a file
    nor Jinja is an error naming the flag."""
    import kvserve.cli as cli
    from tests.conftest import tiny_llm

    assert cli.main(["generate", "hi", *TINY, "--max-tokens", "1", "--chat-template", str(tmp_path / "nope")]) == 2
    assert "error: --chat-template" in capsys.readouterr().err
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert cli.main(["generate", "hi", *TINY, "--max-tokens", "1", "--chat-template", str(path)]) == 0
    out = capsys.readouterr()
    n = len(tiny_llm().tokenizer.encode("[hi]", add_special_tokens=False))  # the template's rendering (the
    assert n < 10  # model's own template makes 31 tokens of it)
    assert f"({n} prompt tokens)" in out.out + out.err and "no chat template" not in out.err


def test_generate_says_when_the_model_has_no_chat_template(monkeypatch, capsys):
    """A model without a chat template (e.g. the bundled Gemma-3 base GGUF) gets the prompt as is, and the
    user is told so; with a template (or --raw) there is no note."""
    import kvserve.cli as cli

    real_build = cli.build_llm
    for template, raw, noted in ((None, False, True), ("{{ messages }}", False, False), (None, True, False)):
        def build(a, template=template):
            llm = real_build(a)
            monkeypatch.setattr(llm.tokenizer, "chat_template", template, raising=False)
            return llm
        monkeypatch.setattr(cli, "build_llm", build)
        rc = cli.main(["generate", "hi", *TINY, "--max-tokens", "2", *(["--raw"] if raw else [])])
        err = capsys.readouterr().err
        assert rc == 0 and ("no chat template" in err) == noted, (template, raw, err[:200])


def test_peer_process_gets_the_users_openmp_settings_not_kvserves(monkeypatch):
    """A peer runs with the OpenMP variables its users would have: the ones kvserve set at import are
    removed, the user's own are kept (llama.cpp's and HF's figures must not ride on kvserve's tuning)."""
    import kvserve
    from kvserve.bench.peer_process import run_peer_process

    monkeypatch.setenv("GOMP_SPINCOUNT", "2000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(kvserve, "SET_GOMP_SPINCOUNT", True)  # as if kvserve had set both
    assert run_peer_process("kvserve.bench.peer_process", [], "env") == {"GOMP_SPINCOUNT": None,
                                                                         "OMP_WAIT_POLICY": None}
    monkeypatch.setattr(kvserve, "SET_GOMP_SPINCOUNT", False)  # the user set them
    assert run_peer_process("kvserve.bench.peer_process", [], "env") == {"GOMP_SPINCOUNT": "2000",
                                                                         "OMP_WAIT_POLICY": "ACTIVE"}


def test_hf_peer_runs_in_its_own_process_on_the_bundled_gguf():
    """--compare hf's peer end to end at a tiny context: TTFT and one gap per token after the first."""
    import torch

    from kvserve.bench.hf_peer import run_hf_in_subprocess
    from kvserve.models.catalog import resolve_model

    out = run_hf_in_subprocess(resolve_model("smollm2-135m", "auto"), torch.float32, [8, 12], 3, 49152, 2)
    assert sorted(out) == [8, 12]
    assert all(r["ttft_ms"] > 0 and len(r["itl_ms"]) == 2 and min(r["itl_ms"]) > 0 for r in out.values())


def test_bench_step_read_is_a_plain_read_of_one_steps_bytes(monkeypatch):
    """run_context reads a buffer of exactly the decode steps' mean bytes and reports that rate; the table
    shows achieved ÷ that rate (hand-computed: 12.5 of 50 GB/s = 25 %)."""
    from kvserve.bench import latency
    from kvserve.bench.latency import ContextResult, LatencyReport, format_report
    from tests.conftest import tiny_llm

    sizes = []
    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda n=1 << 30, repeats=5: sizes.append(n) or 40e9)
    r = latency.run_context(tiny_llm(), 24, 4, 20e9)
    assert sizes == [int(r.decode_bytes_per_step)] and r.decode_bytes_per_step > 0
    assert r.step_read_gb_per_s == 40.0
    rep = LatencyReport("m", "f", 20.0, contexts=[ContextResult(128, 50.0, 9.0, 8.0, 10.0, 1e8, 12.5, 5.0,
                                                                step_read_gb_per_s=50.0)])
    row = format_report(rep).splitlines()[4].split()
    assert row[6:8] == ["62%", "5.00"] and row[9:11] == ["50.0", "25%"]
    assert "% step" in format_report(rep).splitlines()[3]
    # a step of 1 GiB or more reads from DRAM anyway: the plain read, with no buffer of the model's size
    sizes.clear()
    assert latency.step_read_gb_per_s(40e9, 18e9) == 18.0 and sizes == []


def test_anatomy_step_table_says_when_it_shows_a_sample_of_the_steps():
    from kvserve.metrics.report import _format_steps
    from kvserve.metrics.step_stats import StepStats

    steps = [StepStats(i, 0.0, 0.01, 1, 1, 1, 80e6, 0, 0) for i in range(1, 21)]
    text = "\n".join(_format_steps(steps, 8))
    assert "8 of 20 steps shown, evenly spaced" in text
    rows = [line.split()[0] for line in text.splitlines()[3:-1]]
    assert rows[0] == "1" and rows[-1] == "20" and len(rows) == 8
    assert "shown" not in "\n".join(_format_steps(steps[:8], 8))


def test_bench_latency_temperature_reaches_every_run_and_the_llamacpp_peer(monkeypatch):
    """--temperature T samples every kvserve run at T (the report says so) and asks llama.cpp for the
    same: temp T with its top-k off (0); temperature 0 stays greedy (top-k 1)."""
    from kvserve.bench import latency
    from kvserve.bench.llamacpp_peer import llamacpp_latency
    from tests.conftest import tiny_llm

    llm = tiny_llm()
    seen = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, sp, **k: seen.append(sp) or real(prompts, sp, **k))
    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda n=1 << 30, repeats=5: 20e9)
    rep = latency.run_latency_bench(llm, [16], 3, [1, 2], 8, 3, temperature=0.7)
    assert [sp.temperature for sp in seen[1:]] == [0.7, 0.7, 0.7]  # after the warm-up: context, 1, 2 requests
    text = latency.format_report(rep)
    assert "temperature 0.7, full distribution" in text.splitlines()[0]
    assert "concurrency (temperature 0.7, ignore_eos" in text and "greedy" not in text
    greedy = latency.format_report(latency.LatencyReport("m", "f", 20.0, throughput=rep.throughput))
    assert "; greedy" in greedy.splitlines()[0] and "concurrency (greedy, ignore_eos" in greedy

    class FakeLlama:
        def reset(self):
            pass

        def generate(self, ids, **kw):
            calls.append(kw)
            yield from range(100)

    for temperature, top_k in [(0.0, 1), (0.8, 0)]:
        calls = []
        llamacpp_latency(FakeLlama(), [1, 2, 3], 4, temperature)
        assert (calls[0]["temp"], calls[0]["top_k"], calls[0]["top_p"], calls[0]["min_p"]) == (temperature, top_k, 1.0, 0.0)


def test_bench_latency_every_run_prefills_every_prompt(monkeypatch):
    """Every run sends prompts no earlier run sent, across runs, kinds of run and rounds: with the prefix
    cache on (the default), a repeated prompt, or one that starts with an earlier one, skips prefill and
    flatters that run. Here, with integer seeds, the 2-request run's seeds 1001-1002 met the 1001-token
    context's seed 1001, whose prompt starts with the same 48 tokens. Every run must compute all its
    prompt tokens."""
    from kvserve.bench import latency
    from tests.conftest import tiny_llm

    llm = tiny_llm(block_size=16, max_model_len=1100)
    assert llm.engine.config.cache.enable_prefix_caching
    eng = llm.engine
    runs = []

    def spy(fn, kind):
        def run(llm_, n, *a, **k):
            first = eng.num_steps + 1
            r = fn(llm_, n, *a, **k)
            runs.append((kind, n, sum(s.num_prefill_tokens for s in eng.step_stats if s.step >= first)))
            return r
        return run

    monkeypatch.setattr(latency, "run_concurrency", spy(latency.run_concurrency, "c"))
    monkeypatch.setattr(latency, "run_context", spy(latency.run_context, "ctx"))
    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda n=1 << 30, repeats=5: 20e9)
    rep = latency.run_latency_bench(llm, [1001], 2, [1, 2, 2, 3], 48, 2, repeats=2)  # a repeated concurrency runs once
    one_round = [("ctx", 1001, 1001), ("c", 1, 48), ("c", 2, 96), ("c", 3, 144)]
    assert runs == one_round * 2
    assert [t.concurrency for t in rep.throughput] == [1, 2, 3] and all(t.rounds == 2 for t in rep.throughput)


def test_bench_latency_repeats_report_medians_of_fresh_rounds(monkeypatch):
    """--repeats 3: three rounds, each with its own 1 GiB plain read (10, 40, 20 GB/s here), its own
    prompts (every round prefills all its prompt tokens) and its own peer run on the same prompts. Each
    reported figure is the median of the rounds' (hand-checked below from the rounds themselves), and
    % read is the median of each round's achieved ÷ that round's read."""
    import statistics

    from kvserve.bench import latency, llamacpp_peer
    from kvserve.models import catalog
    from tests.conftest import tiny_llm

    llm = tiny_llm(block_size=16)
    eng = llm.engine
    reads = iter([10e9, 40e9, 20e9])
    monkeypatch.setattr(latency, "measure_read_bandwidth",
                        lambda n=1 << 30, repeats=5: next(reads) if n == 1 << 30 else 30e9)
    rounds, prefill = [], []
    real = latency.run_context

    def spy(llm_, ctx, *a, **k):
        first = eng.num_steps + 1
        rounds.append(real(llm_, ctx, *a, **k))
        prefill.append(sum(s.num_prefill_tokens for s in eng.step_stats if s.step >= first))
        return rounds[-1]

    peer_rounds, peer_itl = [], {0: [5.0, 5.0], 1: [9.0, 9.0], 2: [7.0, 7.0]}

    def fake_peer(source, contexts, output_tokens, vocab, threads, temperature, round_):
        peer_rounds.append((contexts, round_))
        return {c: {"ttft_ms": 100.0 + round_, "itl_ms": peer_itl[round_]} for c in contexts}

    monkeypatch.setattr(latency, "run_context", spy)
    monkeypatch.setattr(llamacpp_peer, "run_llamacpp_in_subprocess", fake_peer)
    monkeypatch.setattr(catalog, "resolve_model", lambda model, fmt: None)
    rep = latency.run_latency_bench(llm, [32], 3, [1], 16, 2, compare="llama.cpp", repeats=3)
    assert prefill == [32, 32, 32] and peer_rounds == [([32], 0), ([32], 1), ([32], 2)]
    assert rep.read_gb_per_s == 20.0 and rep.read_rounds_gb_per_s == [10.0, 40.0, 20.0]
    row = rep.contexts[0]
    assert row.rounds == 3 and row.context_tokens == 32
    assert row.itl_p50_rounds_ms == [r.itl_p50_ms for r in rounds]
    assert row.itl_p50_ms == statistics.median(r.itl_p50_ms for r in rounds)
    assert row.ttft_ms == statistics.median(r.ttft_ms for r in rounds)
    shares = [r.achieved_gb_per_s / bw for r, bw in zip(rounds, [10.0, 40.0, 20.0])]
    assert row.read_share == pytest.approx(statistics.median(shares))
    assert row.peer_itl_p50_ms == 7.0 and row.peer_ttft_ms == 101.0 and row.peer_itl_p50_rounds_ms == [5.0, 9.0, 7.0]
    assert rep.throughput[0].rounds == 3
    text = latency.format_report(rep)
    assert text.splitlines()[-1].startswith("  medians of 3 rounds, each column its own")
    per_round = rep.throughput[0].tokens_per_s_rounds
    assert len(per_round) == 3 and rep.throughput[0].output_tokens_per_s == statistics.median(per_round)
    assert text.splitlines()[-1].endswith("out tok/s per round: 1: " + " ".join(f"{v:.1f}" for v in per_round))
    assert "medians of 3 rounds (plain read 10.0-40.0 GB/s" in text
    assert "llama.cpp ITL p50 per round: 32: 5.00 9.00 7.00" in text
    assert text.splitlines()[4].split()[6] == f"{100 * statistics.median(shares):.0f}%"
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        latency.run_latency_bench(llm, [32], 3, [], 16, 2, repeats=0)


def test_bench_latency_unwritable_json_fails_before_benchmarking(tmp_path, capsys, monkeypatch):
    from kvserve.bench import latency
    from kvserve.cli import main

    from kvserve.bench import serve
    from kvserve.eval import ppl

    monkeypatch.setattr(latency, "run_latency_bench", lambda *a, **k: pytest.fail("benchmark ran"))
    monkeypatch.setattr(serve, "run_serve_bench", lambda *a, **k: pytest.fail("benchmark ran"))
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: pytest.fail("evaluation ran"))
    for path in (tmp_path / "missing" / "x.json", tmp_path):
        for argv, flag in [(["bench", "latency", *TINY, "--contexts", "32", "--json"], "--json"),
                           (["bench", "serve", "--save-result"], "--save-result"),
                           (["eval", "ppl", *TINY, "--json"], "--json")]:
            rc = main([*argv, str(path)])
            assert rc != 0 and f"{flag} '{path}': cannot write a file there" in capsys.readouterr().err, argv


@pytest.mark.parametrize("args,needle", [
    (["--contexts", "32,600"], "--output-tokens 32 + the longest of contexts (600 tokens) = 632 exceeds max_model_len 512"),
    (["--contexts", "32", "--output-tokens", "481"],
     "--output-tokens 481 + the longest of contexts (32 tokens) = 513 exceeds max_model_len 512"),
    (["--contexts", "32", "--concurrency-prompt-tokens", "500"],
     "--concurrency-prompt-tokens 500 + concurrency_output_tokens 64 = 564 exceeds max_model_len 512")])
def test_bench_latency_lengths_past_max_model_len_fail_before_any_run(args, needle, capsys, monkeypatch):
    """A context or concurrent request longer than the engine takes fails before the plain read and the
    first runs (an adversarial review: it failed minutes in, when its run came), naming the limit."""
    from kvserve.bench import latency
    from kvserve.cli import main

    monkeypatch.setattr(latency, "measure_read_bandwidth", lambda *a, **k: pytest.fail("benchmark ran"))
    assert main(["bench", "latency", *TINY, *args]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--contexts", "--concurrency"])
def test_bench_latency_empty_lists_are_refused(flag, capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "latency", *TINY, flag, ""])
    assert f"{flag}: expected at least one integer" in capsys.readouterr().err


def test_bench_latency_repeats_flag_is_checked(capsys, monkeypatch):
    from kvserve.bench import latency
    from kvserve.cli import main

    monkeypatch.setattr(latency, "run_latency_bench", lambda *a, **k: pytest.fail("benchmark ran"))
    with pytest.raises(SystemExit):
        main(["bench", "latency", *TINY, "--repeats", "0"])
    assert "--repeats: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [(["--temperature", "2.5"], "--temperature: must be in [0, 2]"),
                                         (["--temperature", "hot"], "--temperature: expected a number"),
                                         (["--temperature", "0.5", "--compare", "hf"], "the HF peer decodes greedily")])
def test_bench_latency_temperature_errors_name_the_flag(args, needle, capsys, monkeypatch):
    from kvserve.bench import latency
    from kvserve.cli import main

    monkeypatch.setattr(latency, "run_latency_bench", lambda *a, **k: pytest.fail("benchmark ran"))
    with pytest.raises(SystemExit) if "hf" not in args else contextlib.nullcontext():
        rc = main(["bench", "latency", "--model", "smollm2-135m", "--contexts", "32", *args])
        assert rc != 0
    assert needle in capsys.readouterr().err


def test_anatomy_step_table_shows_tokens_beside_sequences():
    """A speculative verification step: 1 sequence, 5 tokens (its new token and 4 proposals)."""
    from kvserve.metrics.report import _format_steps
    from kvserve.metrics.step_stats import StepStats

    lines = _format_steps([StepStats(3, 0.0, 0.01, 1, 5, 5, 80e6, 2e6, 100)], 8)
    assert lines[2].split()[:3] == ["step", "seqs", "tokens"]
    assert lines[3].split()[:3] == ["3", "1", "5"]
