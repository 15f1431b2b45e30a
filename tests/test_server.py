"""The HTTP server through the official `openai` client and raw HTTP: answers, streams, metrics that
agree with the responses, aborts on disconnect, auth, 64 concurrent streams, clean SIGTERM."""
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import ServerHandle, tiny_llm


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused")


def _metric(url, name):
    """Sum of a Prometheus series (all label sets) from /metrics."""
    text = httpx.get(url + "/metrics").text
    vals = [float(m.group(1)) for m in re.finditer(rf"^kvserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(vals)


def _wait_idle(server, timeout=10.0):
    deadline = time.time() + timeout
    eng = server.engine
    while time.time() < deadline:
        if not eng.has_unfinished_requests() and eng.kv_manager.num_free_blocks == eng.num_kv_blocks:
            return True
        time.sleep(0.05)
    return False


def test_completion_and_chat_with_openai_client(client):
    r = client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1 and r.choices[0].text
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 2
    c = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].finish_reason == "length"
    assert c.model_extra["kvserve_timings"]["ttft_ms"] > 0
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]


def test_logit_bias_through_the_openai_client(client):
    """logit_bias from the openai client (JSON keys are strings): +100 on one token makes every greedy
    token that token, on both endpoints (compared with the echoed text of that token repeated)."""
    forced = 1234

    def repeated(n: int) -> str:
        return client.completions.create(model="tiny-llama", prompt=[forced] * n, max_tokens=0, echo=True).choices[0].text

    r = client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == repeated(4)
    c = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0.8, seed=1, logit_bias={str(forced): 100})
    assert c.choices[0].message.content == repeated(3)
    plain = client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=4, temperature=0)
    assert plain.choices[0].text != r.choices[0].text  # the bias did something


def test_models_retrieve_through_the_openai_client(client):
    """GET /v1/models/{id} (the client's models.retrieve) answers the served model's card, and a 404
    model_not_found for another name; it was a bare 404 route miss (adversarial review)."""
    listed = client.models.list().data[0]
    got = client.models.retrieve("tiny-llama")
    assert got.id == listed.id == "tiny-llama" and got.created == listed.created and got.owned_by == "kvserve"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_non_stream_for_same_seed(client, kind):
    kw = dict(model="tiny-llama", max_tokens=20, temperature=0.9, top_p=0.9, seed=123)
    if kind == "completion":
        whole = client.completions.create(prompt="Once upon", **kw).choices[0].text
        chunks = client.completions.create(prompt="Once upon", stream=True, **kw)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    else:
        msgs = [{"role": "user", "content": "Tell me a story"}]
        whole = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        chunks = client.chat.completions.create(messages=msgs, stream=True, **kw)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole and whole


def test_tokenize_detokenize_round_trip(tiny_server):
    t = httpx.post(tiny_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) == 2 and t["max_model_len"] == 512
    d = httpx.post(tiny_server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"


def test_metrics_match_the_responses_own_timings(tiny_server, client):
    url = tiny_server.url
    ttft_n0, ttft_s0 = _metric(url, "time_to_first_token_seconds_count"), _metric(url, "time_to_first_token_seconds_sum")
    itl_n0 = _metric(url, "inter_token_latency_seconds_count")
    gen0, prompt0 = _metric(url, "generation_tokens_total"), _metric(url, "prompt_tokens_total")
    r = client.completions.create(model="tiny-llama", prompt="metrics", max_tokens=9, temperature=0)
    timings = r.model_extra["kvserve_timings"]
    assert _metric(url, "time_to_first_token_seconds_count") == ttft_n0 + 1
    assert abs(_metric(url, "time_to_first_token_seconds_sum") - ttft_s0 - timings["ttft_ms"] / 1e3) < 1e-5
    assert _metric(url, "inter_token_latency_seconds_count") == itl_n0 + r.usage.completion_tokens - 1
    assert _metric(url, "generation_tokens_total") == gen0 + 9
    assert _metric(url, "prompt_tokens_total") == prompt0 + r.usage.prompt_tokens
    # vLLM's meaning: every choice's prompt, prefix-cache hits included (the second request finds the
    # first one's full blocks in the cache)
    hits0, prompt1 = _metric(url, "prefix_cache_hits_total"), _metric(url, "prompt_tokens_total")
    for _ in range(2):
        r2 = client.completions.create(model="tiny-llama", prompt="cache me " * 20, max_tokens=2, temperature=0, n=2)
    assert _metric(url, "prefix_cache_hits_total") > hits0
    assert _metric(url, "prompt_tokens_total") == prompt1 + 2 * 2 * r2.usage.prompt_tokens
    assert _metric(url, "num_requests_running") == 0
    assert _metric(url, "kv_cache_bytes_per_token") == 2 * 2 * 2 * 16 * 4
    assert _metric(url, "step_weight_bytes_total") > 0 and _metric(url, "step_kv_bytes_total") > 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(tiny_server):
    body = {"prompt": "stream forever " * 10, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
        assert tiny_server.engine.has_unfinished_requests()
    assert _wait_idle(tiny_server), "request not aborted after the client left"
    assert _metric(tiny_server.url, "num_requests_running") == 0
    gen = _metric(tiny_server.url, "generation_tokens_total")
    time.sleep(0.5)
    assert _metric(tiny_server.url, "generation_tokens_total") == gen  # counters stopped


def test_disconnect_mid_non_stream_aborts(tiny_server, monkeypatch):
    # each engine step held 5 ms, so 450 tokens take > 2 s whatever the host's speed: the client's 1 s
    # timeout always leaves mid-request (with the sampler 30x faster, the tiny model once finished first)
    step = tiny_server.engine.step
    monkeypatch.setattr(tiny_server.engine, "step", lambda: (time.sleep(0.005), step())[1])
    before = _metric(tiny_server.url, "generation_tokens_total")
    body = {"prompt": "wait for me " * 10, "max_tokens": 450, "ignore_eos": True}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=1.0)
        assert _wait_idle(tiny_server), "non-stream request not aborted after the client left"
        time.sleep(0.3)  # the handler's answer to no one, after the abort
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    # a disconnect is not a server error: it was logged as "Exception in ASGI application" with a traceback
    assert not records, [r.getMessage() for r in records]
    assert _metric(tiny_server.url, "generation_tokens_total") - before < 450  # it stopped early
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "next", "max_tokens": 2})
    assert ok.status_code == 200


def test_64_concurrent_streams(tiny_server):
    async def one(c, i):
        body = {"prompt": f"client {i} says", "max_tokens": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        lines = []
        async with c.stream("POST", tiny_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        return json.loads(lines[-2][6:])["usage"]["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    assert asyncio.run(main()) == [8] * 64
    assert _wait_idle(tiny_server)


def test_api_key():
    h = ServerHandle(tiny_llm(), api_key="sekret")
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(h.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(h.url + "/v1/models").status_code == 401
        ok = httpx.post(h.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(h.url + "/health").status_code == 200
        assert httpx.get(h.url + "/metrics").status_code == 200
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="sekret")
        assert c.completions.create(model="tiny-llama", prompt="x", max_tokens=1).choices
    finally:
        h.stop()


def test_sigterm_shuts_down_cleanly_mid_stream(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", "tiny-llama", "--load-format",
                             "dummy", "--max-model-len", "512", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        received = []

        def stream():
            body = {"prompt": "long " * 5, "max_tokens": 480, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        received.append(line)
            except httpx.HTTPError:
                received.append("<closed>")

        t = threading.Thread(target=stream)
        t.start()
        while len(received) < 4:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the captured signal: exit status -SIGTERM
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        out = proc.stdout.read()
        assert "Traceback" not in out, out
        t.join(10)
        assert not t.is_alive()  # the client's stream ended too: nothing hangs
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_serve_against_the_real_server(tiny_server, tmp_path, capsys):
    """The load generator end to end against kvserve itself: every request succeeds, token counts
    come from the server's usage, and the server's own TTFT histogram saw every request."""
    from kvserve.cli import main

    n0 = _metric(tiny_server.url, "time_to_first_token_seconds_count")
    path = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--url", tiny_server.url, "--num-prompts", "12", "--request-rate", "20",
               "--max-concurrency", "4", "--input-tokens", "16", "--output-tokens", "6", "--prompt-format",
               "token-ids", "--save-result", str(path)])
    assert rc == 0
    m = json.loads(path.read_text())["metrics"]
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (12, 0, 192, 72)
    assert m["ttft"]["median_ms"] > 0 and m["itl"]["median_ms"] > 0
    assert _metric(tiny_server.url, "time_to_first_token_seconds_count") == n0 + 12
    assert _wait_idle(tiny_server)


def test_speculative_server_and_per_request_opt_out():
    """A server with draft-model speculation (the draft has the target's weights, so proposals are
    right) gives the same greedy text as without, reports acceptance in /metrics, and a request with
    speculative: false does not speculate."""
    plain = ServerHandle(tiny_llm())
    spec = ServerHandle(tiny_llm(speculative_method="draft", draft_model="tiny-llama", draft_load_format="dummy"))
    try:
        body = {"prompt": "a b c a b c a b c a b c", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        ref = httpx.post(plain.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        r = httpx.post(spec.url + "/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == ref
        assert r["kvserve_timings"]["num_drafts"] > 0
        assert _metric(spec.url, "spec_decode_num_drafts_total") == r["kvserve_timings"]["num_drafts"]
        off = httpx.post(spec.url + "/v1/completions", json=dict(body, speculative=False)).json()
        assert off["choices"][0]["text"] == ref and off["kvserve_timings"]["num_drafts"] == 0
    finally:
        plain.stop()
        spec.stop()


def test_metrics_observe_each_choice_of_an_n_request_once():
    """A new-user finding: an ``n > 1`` request's output repeats a choice that has finished on every
    later step until its last choice ends, and each repeat was observed again (n = 2 with one choice
    stopping early: 49 TTFT samples for 2 choices). Each choice must be observed once: the oracle is
    the choices' own latencies in the final output."""
    from kvserve import SamplingParams
    from kvserve.metrics.prometheus import ServerMetrics

    llm = tiny_llm()
    base = dict(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    a, b = (c.token_ids for c in llm.generate([[5, 6, 7]], SamplingParams(**base))[0].outputs)
    stop = next(t for t in a[1:6] if t not in b)  # ends choice 0 early, not choice 1
    engine, metrics = llm.engine, ServerMetrics("tiny")
    engine.add_request("r", [5, 6, 7], SamplingParams(**base, stop_token_ids=[stop]))
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        metrics.on_step(engine, outs)
        final = next((o for o in outs if o.finished), final)
    choices = final.outputs
    assert [c.finish_reason for c in choices] == ["stop", "length"]
    assert len(choices[0].token_ids) < len(choices[1].token_ids)

    def sample(name, **labels):
        return metrics.registry.get_sample_value("kvserve:" + name, {"model_name": "tiny", **labels})

    assert sample("time_to_first_token_seconds_count") == 2
    assert sample("e2e_request_latency_seconds_count") == 2
    assert sample("inter_token_latency_seconds_count") == sum(len(c.latency.itl_ms) for c in choices)
    assert sample("request_success_total", finished_reason="stop") == 1
    assert sample("request_success_total", finished_reason="length") == 1
    assert abs(sample("time_to_first_token_seconds_sum") - sum(c.latency.ttft_ms for c in choices) / 1e3) < 1e-9
    assert not metrics._observed  # nothing kept once the request is done
