"""``kvserve bench serve``: an HTTP load generator for any OpenAI-compatible streaming server.

Sends ``num_prompts`` streamed requests at Poisson arrival times (``request_rate`` req/s, ``inf`` = all at
once), at most ``max_concurrency`` in flight, times every streamed chunk at the client with
``time.perf_counter()`` and summarises the latencies with the definitions of vLLM's
``benchmarks/benchmark_serving.py`` / ``vllm bench serve`` (``calculate_metrics`` and the OpenAI request
functions in ``backend_request_func.py``), so figures can be set beside that tool's.

Metrics. A request's clock starts when it is sent, i.e. after it got a concurrency slot (as in vLLM);
time waiting for a slot is therefore not in its TTFT. A "token chunk" is an SSE chunk whose
``choices[i].text`` / ``choices[i].delta.content`` is non-empty.
- TTFT: send -> first token chunk.
- ITL: every gap between two consecutive token chunks of a request, all requests pooled (a chunk that
  carries several tokens gives one gap, as in vLLM).
- E2E latency (E2EL): send -> last token chunk.
- TPOT, per request: (E2EL - TTFT) / (output_tokens - 1); requests with one output token have no TPOT
  (and count as TPOT 0 for goodput, as in vLLM).
- Output tokens: ``usage.completion_tokens`` of the final usage chunk when present, else the number of
  token chunks. Input tokens: ``usage.prompt_tokens`` when present, else the requested length.
- Request throughput = successful requests / duration; output token throughput = their output tokens /
  duration; total token throughput = (input + output tokens) / duration. Duration runs from the first
  send to the last response.
- Goodput (DistServe, Zhong et al., OSDI 2024; vLLM's ``--goodput``): successful requests per second
  whose TTFT, TPOT and E2EL are each <= the given SLO in ms (only the SLOs given are checked).
Each latency is summarised as mean, std, median (p50), p90 and p99 (linear-interpolated percentiles,
numpy's default). Failed requests (HTTP error, exception, stream without ``[DONE]`` or tokens) are
counted, their messages tallied, and they are left out of every latency and throughput figure.

Prompts (seeded). ``words`` (default, both endpoints): ``input_tokens`` common English words, about one
token each, so the true length is approximate (a chat template adds its own tokens); the reported input
tokens come from the server's ``usage.prompt_tokens``. ``token-ids`` (``/v1/completions`` only): a list of
``input_tokens`` ids drawn from [1000, 20000) sent as ``"prompt": [ids]``, exact when the server accepts
token-id prompts.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from kvserve.metrics.stats import mean, percentile

SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
PROMPT_FORMATS = ("words", "token-ids")
_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or had "
          "by word but what some we can out other were all there when up use your how said an each she which do "
          "their time if will way about many then them write would like so these her long make thing see him two "
          "has look more day could go come did number sound no most people my over know water than call first "
          "who may down side been now find").split()
_TOKEN_ID_RANGE = (1000, 20000)


@dataclass(slots=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_tokens: int = 128
    output_tokens: int = 64
    seed: int = 0
    prompt_format: str = "words"
    goodput_ms: dict[str, float] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0


@dataclass(slots=True)
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(slots=True)
class LatencySummary:
    mean_ms: float
    std_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float


@dataclass(slots=True)
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2el: LatencySummary
    errors: dict[str, int]


@dataclass(slots=True)
class ServeBenchResult:
    config: ServeBenchConfig
    model: str | None
    metrics: ServeMetrics
    requests: list[RequestResult]


# ------------------------------------------------------------------ inputs
def parse_slo(text: str) -> tuple[str, float]:
    """``"ttft:500"`` -> ``("ttft", 500.0)``; names ttft, tpot, e2el (alias e2e), values in ms > 0."""
    name, sep, value = text.partition(":")
    if not sep or name.strip().lower() not in SLO_NAMES:
        raise ValueError(f"expected NAME:MS with NAME one of ttft, tpot, e2el (or e2e), got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"SLO value must be a number of milliseconds, got {text!r}") from None
    if not ms > 0:
        raise ValueError(f"SLO value must be > 0 ms, got {text!r}")
    return SLO_NAMES[name.strip().lower()], ms


def make_prompts(cfg: ServeBenchConfig) -> list[str | list[int]]:
    """``num_prompts`` seeded prompts of ``input_tokens`` words or token ids (see the module docstring)."""
    rng = random.Random(cfg.seed)
    if cfg.prompt_format == "token-ids":
        return [[rng.randrange(*_TOKEN_ID_RANGE) for _ in range(cfg.input_tokens)] for _ in range(cfg.num_prompts)]
    return [" ".join(rng.choices(_WORDS, k=cfg.input_tokens)) for _ in range(cfg.num_prompts)]


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s after start) of a Poisson process: first at 0, then i.i.d. Exp(rate) gaps; all 0 if inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


def build_payload(cfg: ServeBenchConfig, model: str | None, prompt: str | list[int]) -> dict:
    payload: dict = {"max_tokens": cfg.output_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}
    if model is not None:
        payload["model"] = model
    if cfg.endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


# ------------------------------------------------------------------ one streamed request
@dataclass(slots=True)
class StreamState:
    """What one SSE stream has told us so far; ``feed`` takes each line with its arrival time."""
    start_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_token_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None

    def feed(self, line: str, now_s: float) -> None:
        line = line.strip()
        if not line.startswith("data:") or self.done:
            return  # blank separators, comments, event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = f"stream error: {_short(json.dumps(chunk['error']))}"
            return
        if any(_choice_text(c) for c in chunk.get("choices") or []):
            self._token_chunk(now_s)
        usage = chunk.get("usage") or {}
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)

    def _token_chunk(self, now_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now_s
        else:
            self.itl_s.append(now_s - self.last_token_s)
        self.last_token_s = now_s
        self.num_token_chunks += 1

    def result(self, default_prompt_tokens: int) -> RequestResult:
        if self.error is None and not self.done:
            self.error = "stream ended before data: [DONE]"
        if self.error is None and self.first_token_s is None:
            self.error = "no tokens in the stream"
        if self.error is not None:
            return RequestResult(False, error=self.error)
        out = self.completion_tokens if self.completion_tokens is not None else self.num_token_chunks
        return RequestResult(True, self.prompt_tokens if self.prompt_tokens is not None else default_prompt_tokens,
                             out, self.first_token_s - self.start_s, self.last_token_s - self.start_s, self.itl_s)


def _choice_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def send_request(client, url: str, headers: dict, payload: dict, default_prompt_tokens: int) -> RequestResult:
    """POST one streamed request and time its chunks; never raises (failures become ``success=False``)."""
    start_s = time.perf_counter()
    state = StreamState(start_s)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code >= 400:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {_short(body)}")
            async for line in resp.aiter_lines():
                state.feed(line, time.perf_counter())
                if state.error is not None:
                    break
    except Exception as e:  # noqa: BLE001 - any failure of one request is recorded, never fatal
        return RequestResult(False, error=f"{type(e).__name__}: {_short(str(e))}")
    return state.result(default_prompt_tokens)


# ------------------------------------------------------------------ the run
async def _resolve_model(client, cfg: ServeBenchConfig, headers: dict) -> str | None:
    """``cfg.model``, else the first id of ``GET /v1/models``, else None (no ``model`` field is sent)."""
    if cfg.model is not None:
        return cfg.model
    try:
        resp = await client.get(cfg.url.rstrip("/") + "/v1/models", headers=headers)
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except Exception:  # noqa: BLE001 - the model name is optional
        return None


async def _run_requests(cfg: ServeBenchConfig) -> tuple[str | None, list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    url = cfg.url.rstrip("/") + cfg.endpoint
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    # trust_env=False: a proxy in between would distort every latency measured.
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False) as client:
        model = await _resolve_model(client, cfg, headers)

        async def one(prompt: str | list[int]) -> RequestResult:
            payload = build_payload(cfg, model, prompt)
            if sem is None:
                return await send_request(client, url, headers, payload, cfg.input_tokens)
            async with sem:
                return await send_request(client, url, headers, payload, cfg.input_tokens)

        tasks = []
        start_s = time.perf_counter()
        for offset_s, prompt in zip(arrival_offsets_s(cfg.num_prompts, cfg.request_rate, cfg.seed), make_prompts(cfg)):
            delay_s = start_s + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        return model, list(results), time.perf_counter() - start_s


def validate_config(cfg: ServeBenchConfig) -> None:
    """Raise ``ValueError`` with a message a user can act on."""
    if cfg.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {cfg.endpoint!r}")
    if cfg.prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {cfg.prompt_format!r}")
    if cfg.prompt_format == "token-ids" and cfg.endpoint != "/v1/completions":
        raise ValueError("prompt_format 'token-ids' needs the /v1/completions endpoint")
    for name, value in (("num_prompts", cfg.num_prompts), ("input_tokens", cfg.input_tokens),
                        ("output_tokens", cfg.output_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not cfg.request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {cfg.request_rate}")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    if not cfg.timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {cfg.timeout_s}")
    if not cfg.url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {cfg.url!r}")


def run_serve_bench(cfg: ServeBenchConfig) -> ServeBenchResult:
    """Run the whole benchmark (blocking); see the module docstring for what is measured."""
    validate_config(cfg)
    model, results, duration_s = asyncio.run(_run_requests(cfg))
    return ServeBenchResult(cfg, model, compute_metrics(results, duration_s, cfg.goodput_ms), results)


# ------------------------------------------------------------------ metrics
def summarize_ms(values_s: list[float]) -> LatencySummary:
    ms = [v * 1e3 for v in values_s]
    mu = mean(ms)
    std = math.sqrt(mean([(x - mu) ** 2 for x in ms])) if ms else 0.0
    return LatencySummary(mu, std, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def request_tpot_s(r: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output_tokens - 1), vLLM's per-request TPOT; None for a single output token."""
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def meets_slos(r: RequestResult, goodput_ms: dict[str, float]) -> bool:
    values_ms = {"ttft": r.ttft_s * 1e3, "tpot": (request_tpot_s(r) or 0.0) * 1e3, "e2el": r.e2el_s * 1e3}
    return all(values_ms[name] <= slo for name, slo in goodput_ms.items())


def compute_metrics(results: list[RequestResult], duration_s: float, goodput_ms: dict[str, float]) -> ServeMetrics:
    """Aggregate per-request results over a run of ``duration_s`` seconds (definitions: module docstring)."""
    duration_s = max(duration_s, 1e-9)  # a run where every request failed at once can take ~0 s
    ok = [r for r in results if r.success]
    tpots = [t for t in map(request_tpot_s, ok) if t is not None]
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    goodput = sum(meets_slos(r, goodput_ms) for r in ok) / duration_s if goodput_ms else None
    errors = Counter(r.error for r in results if not r.success)
    return ServeMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s, request_goodput=goodput,
        ttft=summarize_ms([r.ttft_s for r in ok]), tpot=summarize_ms(tpots),
        itl=summarize_ms([x for r in ok for x in r.itl_s]), e2el=summarize_ms([r.e2el_s for r in ok]),
        errors=dict(errors.most_common()))


# ------------------------------------------------------------------ output
def _row(label: str, value) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"


def _section(title: str, short: str, s: LatencySummary) -> list[str]:
    return [f"{title:-^50}", _row(f"Mean {short} (ms):", s.mean_ms), _row(f"Median {short} (ms):", s.median_ms),
            _row(f"P90 {short} (ms):", s.p90_ms), _row(f"P99 {short} (ms):", s.p99_ms)]


def format_report(res: ServeBenchResult) -> str:
    """A summary table in the layout of vLLM's ``benchmark_serving.py``, then the tally of errors."""
    m, cfg = res.metrics, res.config
    lines = [f"{' Serving Benchmark Result ':=^50}", _row("Endpoint:", cfg.url.rstrip("/") + cfg.endpoint),
             _row("Model:", res.model or "(none sent)"), _row("Successful requests:", m.completed),
             _row("Failed requests:", m.failed),
             _row("Maximum request concurrency:", cfg.max_concurrency or "unlimited"),
             _row("Request rate configured (req/s):", "inf" if math.isinf(cfg.request_rate) else cfg.request_rate),
             _row("Benchmark duration (s):", m.duration_s), _row("Total input tokens:", m.total_input_tokens),
             _row("Total generated tokens:", m.total_output_tokens),
             _row("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines += [_row("Goodput SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in cfg.goodput_ms.items())),
                  _row("Request goodput (req/s):", m.request_goodput)]
    lines += [_row("Output token throughput (tok/s):", m.output_throughput),
              _row("Total token throughput (tok/s):", m.total_token_throughput)]
    lines += _section("Time to First Token", "TTFT", m.ttft)
    lines += _section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot)
    lines += _section("Inter-token Latency", "ITL", m.itl)
    lines += _section("End-to-end Latency", "E2EL", m.e2el)
    lines.append("=" * 50)
    if m.errors:
        lines.append("Errors (count: message):")
        lines += [f"{n:>6}: {msg}" for msg, n in list(m.errors.items())[:10]]
    return "\n".join(lines)


def result_to_dict(res: ServeBenchResult) -> dict:
    """JSON-ready dict: config (without the API key), metrics, and one record per request."""
    d = asdict(res)
    d["config"].pop("api_key")
    if math.isinf(res.config.request_rate):
        d["config"]["request_rate"] = "inf"
    d["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return d


def save_result(res: ServeBenchResult, path: str) -> None:
    with open(os.path.expanduser(path), "w") as f:
        json.dump(result_to_dict(res), f, indent=2)
