"""``kvserve bench serve`` against a fake OpenAI-compatible streaming server (FastAPI + uvicorn on loopback,
in a background thread) whose TTFT and inter-token sleeps are known: the measured TTFT / ITL / TPOT / E2EL
match the sleeps, output tokens come from usage, goodput follows the SLOs, HTTP 500s are counted."""
import asyncio
import json
import math
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.bench.serve import (RequestResult, ServeBenchConfig, StreamState, arrival_offsets_s, compute_metrics,
                                 make_prompts, parse_slo, run_serve_bench)
from kvserve.cli import main

TTFT_S, ITL_S = 0.050, 0.010  # the fake server's sleeps before the first token and between tokens


def fake_app() -> FastAPI:
    app = FastAPI()
    calls = {"flaky": 0}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream(body: dict, chat: bool):
        n = body["max_tokens"]
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if chat:  # OpenAI sends the role first, with no content
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                             "total_tokens": prompt_tokens + n}})
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if body.get("model") == "missing":  # as a server answers a model it does not serve
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        if body.get("model") == "flaky":
            calls["flaky"] += 1
            if calls["flaky"] % 2 == 0:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    return app


@pytest.fixture(scope="module")
def fake_url():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake_app(), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def cfg(url: str, **kw) -> ServeBenchConfig:
    kw = {"num_prompts": 8, "max_concurrency": 4, "input_tokens": 16, "output_tokens": 16, "model": "m", **kw}
    return ServeBenchConfig(url=url, **kw)


def test_latencies_match_the_server_sleeps(fake_url):
    res = run_serve_bench(cfg(fake_url))
    m = res.metrics
    assert (m.completed, m.failed, m.errors) == (8, 0, {})
    assert m.total_output_tokens == 8 * 16 and m.total_input_tokens == 8 * 16  # from usage
    assert all(len(r.itl_s) == 15 for r in res.requests)
    # the bench can never measure less than the server slept; the upper bounds only catch gross
    # mis-measurement (e.g. seconds instead of ms) and leave room for a loaded 2-core machine
    assert 45 <= m.ttft.median_ms <= 1000, m.ttft
    assert 8 <= m.itl.median_ms <= 200, m.itl
    assert 8 <= m.tpot.mean_ms <= 200, m.tpot
    expected_e2el_ms = 1e3 * (TTFT_S + 15 * ITL_S)
    assert expected_e2el_ms * 0.9 <= m.e2el.median_ms <= expected_e2el_ms * 5, m.e2el
    assert m.ttft.median_ms <= m.ttft.p90_ms <= m.ttft.p99_ms
    assert m.request_throughput == pytest.approx(8 / m.duration_s)
    assert m.output_throughput == pytest.approx(8 * 16 / m.duration_s)
    assert m.total_token_throughput == pytest.approx(8 * 32 / m.duration_s)
    assert m.request_goodput is None

    impossible = compute_metrics(res.requests, m.duration_s, {"ttft": 1.0})
    loose = compute_metrics(res.requests, m.duration_s, {"ttft": 1e5, "tpot": 1e5, "e2el": 1e6})
    assert impossible.request_goodput == 0.0
    assert loose.request_goodput == pytest.approx(m.request_throughput)
    only_tpot = compute_metrics(res.requests, m.duration_s, {"tpot": 0.001})
    assert only_tpot.request_goodput == 0.0


def test_chat_endpoint_poisson_arrivals_and_model_from_v1_models(fake_url):
    res = run_serve_bench(cfg(fake_url, endpoint="/v1/chat/completions", model=None, request_rate=40.0,
                              max_concurrency=None, num_prompts=6, output_tokens=4))
    assert res.model == "fake-model"
    assert (res.metrics.completed, res.metrics.total_output_tokens) == (6, 24)
    assert all(len(r.itl_s) == 3 for r in res.requests)  # the empty role chunk is not a token
    assert res.metrics.ttft.mean_ms >= 45


def test_http_500_and_connection_errors_are_counted_not_raised(fake_url):
    m = run_serve_bench(cfg(fake_url, model="flaky", num_prompts=6)).metrics
    assert (m.completed, m.failed) == (3, 3)
    [(msg, n)] = m.errors.items()
    assert n == 3 and msg.startswith("HTTP 500") and "boom" in msg
    assert m.request_throughput == pytest.approx(3 / m.duration_s)

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    m = run_serve_bench(cfg(f"http://127.0.0.1:{port}", num_prompts=3)).metrics
    assert (m.completed, m.failed) == (0, 3)
    assert "ConnectError" in next(iter(m.errors)) and m.ttft.mean_ms == 0.0


def test_cli_prints_table_and_saves_json(fake_url, tmp_path, capsys):
    path = tmp_path / "res.json"
    rc = main(["bench", "serve", "--url", fake_url, "--num-prompts", "4", "--request-rate", "inf",
               "--max-concurrency", "2", "--input-tokens", "8", "--output-tokens", "5", "--prompt-format", "token-ids",
               "--goodput", "ttft:5000", "tpot:1000", "e2e:10000", "--save-result", str(path), "--api-key", "secret"])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("Serving Benchmark Result", "Successful requests:", "Request goodput (req/s)", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):", "Total token throughput (tok/s):"):
        assert label in out, label
    d = json.loads(path.read_text())
    assert "secret" not in path.read_text() and "api_key" not in d["config"]
    assert d["config"]["request_rate"] == "inf" and d["config"]["goodput_ms"] == {"ttft": 5000, "tpot": 1000,
                                                                                    "e2el": 10000}
    m = d["metrics"]
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (4, 0, 32, 20)
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert set(m[key]) == {"mean_ms", "std_ms", "median_ms", "p90_ms", "p99_ms"}
    assert len(d["requests"]) == 4 and d["model"] == "fake-model"


def test_cli_with_no_server_says_so_instead_of_a_table_of_zeros(capsys):
    """Nothing listens on port 9 (discard) here: every request fails to connect; the table of zero
    latencies that was printed before the error tally said nothing a user could act on."""
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "3", "--model", "m"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Mean TTFT" not in out
    assert "none of the 3 requests to http://127.0.0.1:9 completed (3 x " in err and "is a server running" in err


def test_cli_with_every_request_refused_names_the_reply_not_a_missing_server(fake_url, capsys):
    """A server that answered (HTTP 404 for an unknown model) is not asked about (second review)."""
    rc = main(["bench", "serve", "--url", fake_url, "--num-prompts", "2", "--model", "missing"])
    err = capsys.readouterr().err
    assert rc == 1 and "none of the 2 requests" in err and "404" in err and "is a server running" not in err


def test_cli_rejects_bad_slo_and_token_ids_on_chat(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--goodput", "ttft=500"])
    assert "NAME:MS" in capsys.readouterr().err
    rc = main(["bench", "serve", "--endpoint", "/v1/chat/completions", "--prompt-format", "token-ids"])
    assert rc == 2 and "token-ids" in capsys.readouterr().err
    # the flags a user typed, not ServeBenchConfig's field names (they printed as num_prompts etc.)
    for args, message in ((["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
                          (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
                          (["--request-rate", "-2"], "--request-rate must be > 0 (or inf), got -2.0"),
                          (["--timeout-s", "0"], "--timeout-s must be > 0 seconds, got 0.0")):  # was unchecked
        assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *args]) == 2, args
        assert capsys.readouterr().err.strip() == f"kvserve: error: {message}"


def test_stream_state_counts_tokens_from_usage_else_chunks():
    def feed(lines):
        st = StreamState(start_s=0.0)
        for t, line in enumerate(lines, start=1):
            st.feed(line, t * 0.1)
        return st.result(default_prompt_tokens=7)

    two_tokens = 'data: {"choices": [{"text": "ab"}]}'
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    r = feed([two_tokens, "", ": keep-alive", two_tokens, usage, "data: [DONE]"])
    assert (r.success, r.prompt_tokens, r.output_tokens) == (True, 3, 5)
    assert r.ttft_s == pytest.approx(0.1) and r.e2el_s == pytest.approx(0.4) and r.itl_s == [pytest.approx(0.3)]
    r = feed([two_tokens, two_tokens, "data: [DONE]"])
    assert (r.prompt_tokens, r.output_tokens) == (7, 2)
    assert not feed([two_tokens]).success  # no [DONE]
    assert "no tokens" in feed(["data: [DONE]"]).error
    assert "stream error" in feed(['data: {"error": {"message": "x"}}', "data: [DONE]"]).error


def test_inputs_are_seeded():
    offs = arrival_offsets_s(2000, 4.0, seed=0)
    assert offs[0] == 0.0 and offs == arrival_offsets_s(2000, 4.0, seed=0)
    assert offs[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    c = ServeBenchConfig(num_prompts=3, input_tokens=10, seed=1)
    assert make_prompts(c) == make_prompts(c) and all(len(p.split()) == 10 for p in make_prompts(c))
    c.prompt_format = "token-ids"
    assert all(len(p) == 10 and all(isinstance(x, int) for x in p) for p in make_prompts(c))
    assert parse_slo("e2e:100") == ("e2el", 100.0)
    with pytest.raises(ValueError):
        parse_slo("itl:5")
    assert RequestResult(False).output_tokens == 0
