"""Roofline cost model of one engine step, a prefill (TTFT), a generation (E2E) and memory capacity.

A step's time is max(bytes / achievable bandwidth, FLOPs / achievable FLOP/s) + tensor-parallel
all-reduces + a fixed overhead (Williams et al., "Roofline", CACM 2009). Bytes are counted as the
engine's :class:`~kvserve.metrics.step_stats.StepStats` counts them: every weight once (routed MoE
experts only as touched; the embedding table as the LM head, plus the rows looked up) and, per
sequence, the K/V of all its tokens including this step's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.config import ConfigError
from kvserve.planner.hardware import Efficiency, Hardware
from kvserve.planner.shapes import ModelShape, dtype_bytes

ACTIVATION_BYTES = 2  # bf16 activations in TP all-reduces
GPU_MEMORY_UTILIZATION = 0.9  # share of device memory for weights + KV (vLLM's default gpu_memory_utilization)


MAX_BATCH = 1_000_000  # sequences: Workload.validate's bounds on what plan costs step by step
MAX_PREFILL_STEPS = 100_000
MAX_BATCH_PREFILL_ROWS = 1_000_000  # prompt pieces + decode tokens batch_prefill_steps costs, at most
MAX_MEASURED_MS = 1e9  # ~11.6 days: larger measured times are typos (and their sums overflow to inf)


@dataclass(frozen=True)
class Workload:
    """What is asked: ``batch`` concurrent sequences of ``prompt_tokens`` in / ``output_tokens`` out on
    ``tp`` GPUs. chunk_tokens: prefill chunk (max_num_batched_tokens; 0 = whole prompt in one step).
    tokenize_ms / queue_ms / network_ms: measured inputs added to E2E (0 unless given)."""

    prompt_tokens: int = 8192
    output_tokens: int = 250
    batch: int = 1
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    chunk_tokens: int = 0
    tokenize_ms: float = 0.0
    queue_ms: float = 0.0
    network_ms: float = 0.0
    weight_bytes_per_param: float = 0.0  # > 0: overrides weight_dtype's size (a mixed packed format)
    weight_note: str = ""  # what that mix is, for the report ("GGUF as kept: 120 int4, 1 int8")
    tp_note: str = ""  # how tp was chosen where the user did not give it, for the report

    @property
    def weight_bytes(self) -> float:
        """Bytes per weight read: ``weight_bytes_per_param`` if set, else ``weight_dtype``'s size."""
        return self.weight_bytes_per_param or dtype_bytes(self.weight_dtype)

    def validate(self) -> "Workload":
        for f in ("prompt_tokens", "output_tokens", "batch", "tp", "chunk_tokens"):
            low = 0 if f in ("output_tokens", "chunk_tokens") else 1
            if getattr(self, f) < low:
                raise ConfigError(f"{f} must be >= {low}, got {getattr(self, f)}")
        for f in ("tokenize_ms", "queue_ms", "network_ms"):  # measured times added to TTFT or E2E
            if not 0 <= getattr(self, f) <= MAX_MEASURED_MS:  # NaN fails too
                raise ConfigError(f"{f} must be a time in [0, {MAX_MEASURED_MS:.0e}] ms, got {getattr(self, f)}")
        # the steps are costed one by one (a context per sequence, a prefill chunk per step): bounded so a
        # typo is an error, not minutes of work and gigabytes of lists
        if self.batch > MAX_BATCH:
            raise ConfigError(f"batch must be <= {MAX_BATCH:,}, got {self.batch:,}")
        chunks = math.ceil(self.prompt_tokens / self.chunk_tokens) if self.chunk_tokens else 1
        if chunks > MAX_PREFILL_STEPS:
            raise ConfigError(f"chunk_tokens {self.chunk_tokens:,} cuts {self.prompt_tokens:,} prompt tokens into "
                              f"{chunks:,} prefill steps, more than {MAX_PREFILL_STEPS:,}; give a larger chunk")
        dtype_bytes(self.weight_dtype), dtype_bytes(self.kv_dtype)
        return self


@dataclass(slots=True)
class StepCost:
    """One step on one GPU. Bytes and FLOPs per GPU; times in seconds."""

    num_tokens: int
    context_tokens: float
    weight_bytes: float
    kv_bytes: float
    flops: float
    weight_time_s: float
    kv_time_s: float
    compute_time_s: float
    comm_time_s: float
    overhead_s: float

    @property
    def memory_time_s(self) -> float:
        return self.weight_time_s + self.kv_time_s

    @property
    def time_s(self) -> float:
        return max(self.memory_time_s, self.compute_time_s) + self.comm_time_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_time_s >= self.compute_time_s else "compute"

    def terms_ms(self) -> dict[str, float]:
        return {"weights_ms": self.weight_time_s * 1e3, "kv_ms": self.kv_time_s * 1e3,
                "compute_ms": self.compute_time_s * 1e3, "comm_ms": self.comm_time_s * 1e3,
                "overhead_ms": self.overhead_s * 1e3}

    @property
    def limiter(self) -> str:
        """What the step's time mostly is, of the parts that add up: the overlapped memory/compute part
        (named by ``bound``; weights and KV counted together), the all-reduce ("comm") or the fixed
        overhead ("overhead"). Unlike ``dominant``, 1.6 ms of weights and 1.8 ms of KV outweigh 2 ms of
        overhead."""
        parts = {self.bound: max(self.memory_time_s, self.compute_time_s), "comm": self.comm_time_s,
                 "overhead": self.overhead_s}
        return max(parts, key=parts.get)

    @property
    def dominant(self) -> str:
        """The largest of the terms that add up (memory terms only when memory-bound)."""
        t = self.terms_ms()
        if self.bound == "memory":
            t.pop("compute_ms")
        else:
            t.pop("weights_ms"), t.pop("kv_ms")
        return max(t, key=t.get).removesuffix("_ms")


def tp_split_error(shape: ModelShape, tp: int) -> str | None:
    """Why ``tp`` GPUs cannot split ``shape`` by tensor parallelism, or None when they can: each rank
    takes an equal share of the attention heads, of the KV heads (or, with fewer KV heads than ranks,
    a whole replicated one: ``tp`` a multiple of them) and of the MLP's intermediate width (and each
    expert's, and a Qwen2-MoE shared expert's). These are vLLM's own checks (its Llama attention asserts
    the head rules, its column-parallel linear layers divide their output width by the TP size; a MoE
    model's dense MLP width counts only where it has dense layers). An MLA latent has no KV heads."""
    if shape.num_heads % tp:
        return f"does not divide {shape.name}'s {shape.num_heads} attention heads"
    kv = shape.num_kv_heads
    if shape.attention != "mla" and (kv % tp if kv >= tp else tp % kv):
        how = "does not divide" if kv >= tp else "is not a multiple of"
        return f"{how} {shape.name}'s {kv} KV heads"
    dense = not shape.num_experts or shape.first_k_dense_replace > 0  # a MoE model may have no dense MLP
    for width, what in ((shape.intermediate_size if dense else 0, "MLP intermediate width"),
                        (shape.moe_intermediate_size if shape.num_experts else 0, "experts' intermediate width"),
                        (shape.shared_expert_intermediate_size, "shared expert's intermediate width")):
        if width and width % tp:
            return f"does not divide {shape.name}'s {what} ({width:,})"
    return None


def kv_shard_fraction(shape: ModelShape, tp: int) -> float:
    """Share of a sequence's KV one of ``tp`` GPUs holds: KV heads split across ranks (replicated
    when num_kv_heads < tp); an MLA latent has no heads to split, so every rank holds it all."""
    if shape.attention == "mla":
        return 1.0
    return math.ceil(shape.num_kv_heads / tp) / shape.num_kv_heads


def allreduce_time_s(num_bytes: float, tp: int, hw: Hardware, eff: Efficiency) -> float:
    """Ring all-reduce: 2(n−1) steps of latency plus 2(n−1)/n × bytes over the link
    (Patarasuk & Yuan, J. Parallel Distrib. Comput. 2009; NCCL's "bus bandwidth" convention)."""
    if tp <= 1:
        return 0.0
    steps = 2 * (tp - 1)
    return steps * eff.allreduce_hop_latency_s + steps / tp * num_bytes / hw.interconnect_bytes_per_s


def step_cost(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload, num_tokens: int,
              context_tokens: list[float] | float, attention_flops: float, lm_head_tokens: int) -> StepCost:
    """Cost of one step over ``num_tokens`` tokens whose sequences end at ``context_tokens`` (one
    value per sequence, or their sum), with ``attention_flops`` (all GPUs) and logits for
    ``lm_head_tokens`` tokens. Megatron TP: two all-reduces per layer (Shoeybi et al. 2019, §3)."""
    tp = w.tp
    seq_tokens = sum(context_tokens) if isinstance(context_tokens, list) else context_tokens
    wb = w.weight_bytes
    weight_bytes = (shape.params_read_per_step(num_tokens) * wb + num_tokens * shape.hidden_size * wb) / tp
    kv_bytes = (shape.kv_tokens_read_sum(context_tokens) * shape.kv_bytes_per_token(w.kv_dtype)
                * kv_shard_fraction(shape, tp))
    lm_head = shape.embedding_params()
    matmul = 2 * ((shape.matmul_params_per_token() - lm_head) * num_tokens + lm_head * lm_head_tokens)
    flops = (matmul + attention_flops) / tp
    bw = hw.memory_bandwidth_bytes_per_s
    comm = 2 * shape.num_layers * allreduce_time_s(num_tokens * shape.hidden_size * ACTIVATION_BYTES, tp, hw, eff)
    return StepCost(
        num_tokens=num_tokens, context_tokens=seq_tokens, weight_bytes=weight_bytes, kv_bytes=kv_bytes, flops=flops,
        weight_time_s=weight_bytes / (bw * eff.bandwidth_efficiency),
        kv_time_s=kv_bytes / (bw * eff.kv_efficiency),
        compute_time_s=flops / (hw.peak_flops(w.weight_dtype) * eff.flops_efficiency),
        comm_time_s=comm, overhead_s=eff.step_overhead_s + eff.overhead_per_layer_s * shape.num_layers)


def decode_step(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload, context_tokens: float) -> StepCost:
    """A decode step of ``w.batch`` sequences each holding ``context_tokens`` tokens after this step."""
    attn = w.batch * shape.decode_attention_flops(int(context_tokens))
    return step_cost(shape, hw, eff, w, w.batch, [float(context_tokens)] * w.batch, attn, w.batch)


def prefill_steps(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload) -> list[StepCost]:
    """One request's prompt in chunks of ``w.chunk_tokens`` (0 = one step). FLOPs: 2 × params × tokens
    (Kaplan et al. 2020) + causal attention over each chunk's prefix; logits for the last token only."""
    chunk = w.chunk_tokens or w.prompt_tokens
    one = Workload(**{**w.__dict__, "batch": 1})
    steps = []
    for start in range(0, w.prompt_tokens, chunk):
        n = min(chunk, w.prompt_tokens - start)
        last = start + n == w.prompt_tokens
        attn = shape.prefill_attention_flops(start, n)
        steps.append(step_cost(shape, hw, eff, one, n, [float(start + n)], attn, 1 if last else 0))
    return steps


def batch_prefill_steps(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload) -> list[StepCost]:
    """The steps until the last of ``w.batch`` requests that arrive together has its first token, as
    kvserve's scheduler and vLLM's chunked prefill run them when every request fits at once
    (``max_num_seqs`` ≥ batch, a KV cache that holds them all: no waiting for a slot, no preemption):
    each step has a budget of ``w.chunk_tokens`` tokens (0: all the prompts in one step) and gives it
    first to the requests whose prompts are done, one decode token each, first come first (each
    decodes until its ``output_tokens`` are out), then to the prompts in arrival order, a step taking
    the next request's tokens where one request's end leaves room. Per step: the weights once, 2 ×
    params × tokens, each prompt piece's causal attention over its own prefix and each decode's over its
    context, the KV those read, and logits for the decodes and the pieces that end a prompt. With
    ``w.batch`` = 1 these are :func:`prefill_steps`. Empty past MAX_PREFILL_STEPS steps or
    MAX_BATCH_PREFILL_ROWS pieces and decodes (costed one by one: a valid batch of a million sequences
    in small chunks would take minutes)."""
    budget = w.chunk_tokens or w.prompt_tokens * w.batch
    if math.ceil(w.prompt_tokens * w.batch / budget) > MAX_PREFILL_STEPS:
        return []
    one = Workload(**{**w.__dict__, "batch": 1})
    decoding: list[list[int]] = []  # [tokens held, decode steps left] per request past its prompt
    steps: list[StepCost] = []
    request, start, rows = 0, 0, 0
    while request < w.batch:
        k = min(len(decoding), budget)  # this step's decodes
        rows += k
        if len(steps) == MAX_PREFILL_STEPS or rows > MAX_BATCH_PREFILL_ROWS:  # the decodes took the budget
            return []
        n, attn, contexts, logits = 0, 0.0, [], 0
        for d in decoding[:k]:
            d[0], d[1] = d[0] + 1, d[1] - 1
            attn += shape.decode_attention_flops(d[0])
            contexts.append(float(d[0]))
            n, logits = n + 1, logits + 1
        decoding = [d for d in decoding if d[1] > 0]
        while n < budget and request < w.batch:
            m = min(budget - n, w.prompt_tokens - start)
            attn += shape.prefill_attention_flops(start, m)
            contexts.append(float(start + m))
            n, start = n + m, start + m
            if start == w.prompt_tokens:
                logits, request, start = logits + 1, request + 1, 0
                if w.output_tokens > 1:
                    decoding.append([w.prompt_tokens, w.output_tokens - 1])
        rows += len(contexts) - k  # its prompt pieces
        steps.append(step_cost(shape, hw, eff, one, n, contexts, attn, logits))
    return steps


@dataclass(slots=True)
class Capacity:
    """Memory per GPU, in bytes: ``fits`` when weights + KV of ``batch`` sequences at ``context_tokens``
    (+ a draft model's weights and KV, ``draft_bytes``, on the GPU it runs on) fit in
    GPU_MEMORY_UTILIZATION of memory; ``max_batch`` at that context; ``kv_exceeds_weights_tokens``:
    batch × context at which the KV bytes read per step pass the weight bytes."""

    memory_bytes: float
    weight_bytes: float
    kv_bytes: float
    fits: bool
    max_batch: int
    kv_exceeds_weights_tokens: float
    draft_bytes: float = 0.0


def capacity(shape: ModelShape, hw: Hardware, w: Workload, draft: ModelShape | None = None) -> Capacity:
    """``draft``: a speculative-decoding draft model, run unsharded on one of the ``tp`` GPUs (as
    :func:`kvserve.planner.cli` times it, vLLM's ``draft_tensor_parallel_size=1``) beside that GPU's
    shard of the target: its weights in ``weight_dtype`` and its own KV cache of every sequence in
    ``kv_dtype``, both counted on that GPU, the fullest one. On ``local`` hardware (kvserve on this
    machine) the draft's KV is the engine's fixed pool, ``SpecDecodeConfig.draft_kv_cache_memory_bytes``,
    whatever the batch."""
    from kvserve.config import SpecDecodeConfig

    context = w.prompt_tokens + w.output_tokens
    weights = shape.num_params() * w.weight_bytes / w.tp
    per_seq = shape.kv_bytes_stored(context, w.kv_dtype) * kv_shard_fraction(shape, w.tp)
    draft_weights = draft.num_params() * dtype_bytes(w.weight_dtype) if draft is not None else 0.0
    draft_per_seq = draft.kv_bytes_stored(context, w.kv_dtype) if draft is not None else 0.0
    draft_pool = 0.0
    if draft is not None and hw.hardware_class == "local":
        draft_pool, draft_per_seq = float(SpecDecodeConfig().draft_kv_cache_memory_bytes), 0.0
    budget = hw.memory_bytes * GPU_MEMORY_UTILIZATION
    held, per_seq_held = weights + draft_weights + draft_pool, per_seq + draft_per_seq
    max_batch = max(0, int((budget - held) // per_seq_held)) if per_seq_held else 0
    read_weights = shape.params_read_per_step(w.batch) * w.weight_bytes
    draft_bytes = draft_weights + draft_pool + w.batch * draft_per_seq
    return Capacity(budget, weights, w.batch * per_seq, weights + w.batch * per_seq + draft_bytes <= budget, max_batch,
                    read_weights / shape.kv_bytes_per_token(w.kv_dtype), draft_bytes)


@dataclass(slots=True)
class Plan:
    """Predicted TTFT, mean ITL and E2E (ms) with the steps behind them."""

    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    prefill: list[StepCost]
    decode_first: StepCost
    decode_mean: StepCost
    decode_last: StepCost
    capacity: Capacity
    efficiency: Efficiency
    extras: dict = field(default_factory=dict)
    # the TTFT of the last of ``batch`` requests that arrive together (tokenize + Σ batch_prefill_steps,
    # their queueing modelled there, no queue_ms); ttft_ms less queue_ms at batch 1; None: too many steps
    ttft_batch_ms: float | None = None
    batch_prefill: list[StepCost] = field(default_factory=list)


def plan(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload, draft: ModelShape | None = None) -> Plan:
    """TTFT = tokenize + queue + Σ prefill steps of one request alone; ``ttft_batch_ms`` = tokenize +
    Σ :func:`batch_prefill_steps`, the last of ``batch`` requests that arrive together (no queue: their
    queueing is in those steps); ITL = the decode step at the mean context
    (KV bytes grow linearly, so this is the mean ITL); E2E = TTFT + (N − 1) × ITL + network.
    ``draft``: a draft model whose memory :func:`capacity` counts (its time: ``spec_decode``)."""
    w.validate()
    pre = prefill_steps(shape, hw, eff, w)
    ttft = w.tokenize_ms + w.queue_ms + sum(s.time_s for s in pre) * 1e3
    n = w.output_tokens
    first = decode_step(shape, hw, eff, w, w.prompt_tokens + 1)
    last = decode_step(shape, hw, eff, w, w.prompt_tokens + max(n - 1, 1))
    mean = decode_step(shape, hw, eff, w, w.prompt_tokens + max(n, 2) / 2)
    itl = mean.time_s * 1e3
    e2e = ttft + max(n - 1, 0) * itl + w.network_ms
    # no queue_ms in the batch's figure: its own queueing is in its steps
    together = batch_prefill_steps(shape, hw, eff, w) if w.batch > 1 else pre
    ttft_batch = w.tokenize_ms + sum(s.time_s for s in together) * 1e3 if together else None
    return Plan(ttft, itl, e2e, pre, first, mean, last, capacity(shape, hw, w, draft), eff,
                ttft_batch_ms=ttft_batch, batch_prefill=together)
