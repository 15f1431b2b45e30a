"""Prometheus export. Names follow vLLM's where the meaning is the same (prefix ``kvserve:``
instead of ``vllm:``), so existing dashboards need only the prefix changed; kvserve's own series
report the bytes each step streamed and the bandwidth it achieved.

Request histograms are observed once per finished sequence (each choice of an ``n > 1`` request),
from the same :class:`LatencyBreakdown` the response carries; aborted sequences are not observed.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.outputs import RequestOutput

P = "kvserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self._model = model_name

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(P + name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival at the server to the first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive generated tokens.", _ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1).",
                         _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue = hist("request_queue_time_seconds", "Tokenized to first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token (all prefill chunks).")
        self.decode = hist("request_decode_time_seconds", "First token to last token.")
        self.running = Gauge(P + "num_requests_running", "Sequences in the running batch.", lbl, registry=r).labels(model_name)
        self.waiting = Gauge(P + "num_requests_waiting", "Sequences waiting (incl. preempted).", lbl, registry=r).labels(model_name)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", lbl, registry=r).labels(model_name)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of every sequence that produced a first "
                                     "token (n choices count n times; prefix-cache hits included, as vLLM's).",
                                     lbl, registry=r).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", lbl, registry=r).labels(model_name)
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted (recomputed later).", lbl, registry=r).labels(model_name)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lbl, registry=r).labels(model_name)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", lbl, registry=r).labels(model_name)
        self.success = Counter(P + "request_success", "Finished sequences by finish reason.", lbl + ["finished_reason"], registry=r)
        self.step_weight_bytes = Counter(P + "step_weight_bytes", "Weight bytes streamed by engine steps.", lbl, registry=r).labels(model_name)
        self.step_kv_bytes = Counter(P + "step_kv_bytes", "KV-cache bytes read by engine steps.", lbl, registry=r).labels(model_name)
        self.step_time = hist("step_duration_seconds", "Wall time of one engine step (model + sampling).", _ITL_BUCKETS)
        self.step_bandwidth = Gauge(P + "step_achieved_bandwidth_bytes_per_second",
                                    "(weight + KV bytes) / wall time of the latest step.", lbl, registry=r).labels(model_name)
        self.last_kv_bytes = Gauge(P + "step_kv_bytes_last", "KV bytes read by the latest step.", lbl, registry=r).labels(model_name)
        self.kv_bytes_per_token = Gauge(P + "kv_cache_bytes_per_token", "K+V bytes of one token over all layers.", lbl, registry=r).labels(model_name)
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "Verification steps that carried proposals.", lbl, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Proposed tokens.", lbl, registry=r).labels(model_name)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Accepted proposed tokens.", lbl, registry=r).labels(model_name)
        self.spec_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by draft position.",
                                    lbl + ["position"], registry=r)
        self.spec_rate = Gauge(P + "spec_decode_acceptance_rate", "Accepted / proposed tokens so far.", lbl, registry=r).labels(model_name)
        self.spec_length = Gauge(P + "spec_decode_mean_acceptance_length", "Tokens per verification step (accepted + 1).", lbl, registry=r).labels(model_name)
        self._last_spec = (0, 0, 0, [])
        self._last_step = 0
        self._last_preemptions = 0
        self._last_prefix = (0, 0)
        # choices (request id, index) already observed as finished: an n > 1 request's output repeats a
        # finished choice on every later step until its last choice ends
        self._observed: set[tuple[str, int]] = set()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ called on the engine thread
    def on_step(self, engine, outputs: list[RequestOutput]) -> None:
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_manager.usage)
        self.kv_bytes_per_token.set(engine.kv_spec.bytes_per_token)
        preempt = engine.scheduler.num_preemptions
        self.preemptions.inc(preempt - self._last_preemptions)
        self._last_preemptions = preempt
        self._observe_spec(engine.scheduler.spec_stats)
        kv = engine.kv_manager
        queried, hit = kv.num_queried_tokens, kv.num_hit_tokens
        self.prefix_queries.inc(queried - self._last_prefix[0])
        self.prefix_hits.inc(hit - self._last_prefix[1])
        self._last_prefix = (queried, hit)
        for s in engine.step_stats:
            if s.step <= self._last_step:
                continue
            self.step_weight_bytes.inc(s.weight_bytes)
            self.step_kv_bytes.inc(s.kv_bytes_read)
            self.step_time.observe(s.wall_s)
            self.step_bandwidth.set(s.achieved_bytes_per_s)
            self.last_kv_bytes.set(s.kv_bytes_read)
        self._last_step = engine.num_steps
        for out in outputs:
            for c in out.outputs:
                if c.delta_token_ids and len(c.token_ids) == len(c.delta_token_ids):  # its first tokens
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.generation_tokens.inc(len(c.delta_token_ids))
                if c.finished and (out.request_id, c.index) not in self._observed:
                    self._observed.add((out.request_id, c.index))
                    self._observe_finished(c)
            if out.finished:
                self._observed.difference_update((out.request_id, c.index) for c in out.outputs)

    def _observe_spec(self, s) -> None:
        d, t, a, per = self._last_spec
        self.spec_drafts.inc(s.num_drafts - d)
        self.spec_draft_tokens.inc(s.num_draft_tokens - t)
        self.spec_accepted.inc(s.num_accepted_tokens - a)
        for pos, n in enumerate(s.accepted_per_position):
            prev = per[pos] if pos < len(per) else 0
            if n > prev:
                self.spec_per_pos.labels(self._model, str(pos)).inc(n - prev)
        if s.num_drafts:
            self.spec_rate.set(s.acceptance_rate)
            self.spec_length.set(s.mean_acceptance_length)
        self._last_spec = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position))

    def _observe_finished(self, c) -> None:
        self.success.labels(self._model, c.finish_reason).inc()
        lat = c.latency
        if c.finish_reason == "abort" or lat is None or lat.num_output_tokens == 0:
            return
        ms = 1e-3
        self.ttft.observe(lat.ttft_ms * ms)
        for x in lat.itl_ms:
            self.itl.observe(x * ms)
        if lat.num_output_tokens > 1:
            self.tpot.observe(lat.tpot_ms * ms)
        self.e2e.observe(lat.e2e_ms * ms)
        self.queue.observe(lat.queue_ms * ms)
        self.prefill.observe(lat.prefill_ms * ms)
        self.decode.observe(lat.decode_ms * ms)
