"""``kvserve probe``: measure this machine's achievable rates for the planner's ``local`` hardware —
weight-streaming bandwidth (GEMVs over matrices far larger than the last-level cache), matmul FLOP/s,
the engine's KV-read bandwidth (its own paged decode attention) and the engine's fixed per-step
overhead (its own step loop on a model of negligible width) — and save them as JSON for reuse.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from kvserve import memory
from kvserve.config import ConfigError, ModelConfig
from kvserve.models.linear import linear
from kvserve.planner.hardware import Efficiency, Hardware


def probe_path() -> str:
    """``$KVSERVE_CACHE_DIR/probe.json`` or ``~/.cache/kvserve/probe.json``."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")
    return os.path.join(root, "probe.json")


@dataclass
class ProbeResult:
    """Measured rates (best of several repeats). Per compute dtype name ("float32", "bfloat16"):
    gemv_bytes_per_s (weights streamed by y = W x), matmul_flops (square GEMM), kv_read_bytes_per_s
    (K+V bytes the engine's decode attention reads per second, marginal over context). Engine overhead:
    step_overhead_s (constant per step) and overhead_per_layer_s, from its step loop on a narrow model;
    both 0 with engine_overhead_measured False (skipped), and plans on the probe then count none."""

    num_threads: int
    memory_bytes: float
    gemv_bytes_per_s: dict[str, float] = field(default_factory=dict)
    matmul_flops: dict[str, float] = field(default_factory=dict)
    kv_read_bytes_per_s: dict[str, float] = field(default_factory=dict)
    step_overhead_s: float = 0.0
    overhead_per_layer_s: float = 0.0
    dtype: str = "float32"
    engine_overhead_measured: bool = True  # False after `probe --no-engine`: the two overheads are 0, not measured

    def hardware(self) -> Hardware:
        """This machine as a Hardware row: peaks *are* the measured rates (efficiency 1 for weights)."""
        d = self.dtype
        return Hardware("local", "local", self.memory_bytes, self.gemv_bytes_per_s[d], self.matmul_flops[d],
                        0.0, 1e12, f"kvserve probe ({self.num_threads} threads, {d})")

    def efficiency(self) -> Efficiency:
        """Weights at the measured GEMV rate; KV at the measured attention rate; measured overheads."""
        d = self.dtype
        return Efficiency(bandwidth_efficiency=1.0, kv_bandwidth_efficiency=self.kv_read_bytes_per_s[d] / self.gemv_bytes_per_s[d],
                          flops_efficiency=1.0, step_overhead_s=self.step_overhead_s,
                          overhead_per_layer_s=self.overhead_per_layer_s,
                          calibrated_on=f"kvserve probe ({d})" if self.engine_overhead_measured
                          else f"kvserve probe ({d}; engine overhead not measured, counted as 0)")


class ProbeError(RuntimeError):
    """A rate could not be measured on this host as it is now; the message says why and what to try."""


def _check_positive_ints(**values) -> None:
    """ValueError naming the first value that is not an int >= 1 (a bool is not accepted as an int)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def _best_time(fn, repeats: int) -> float:
    """Best wall seconds of ``repeats`` calls of ``fn`` after one warm-up call. ValueError: repeats < 1."""
    _check_positive_ints(repeats=repeats)
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _random_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Standard-normal tensors of ``shapes`` in one arena of 2 MiB pages (kvserve/memory.py), as the engine
    keeps its weights and KV cache, drawn in place: generating them first and copying them over held every
    byte twice (1 GiB at its peak for measure_gemv's 512 MiB)."""
    mats = memory.zeros_many([(shape, dtype) for shape in shapes])
    for m in mats:
        m.normal_()
    return mats


#: measure_gemv's most matrices: past this, per-call overhead (µs a matrix), not the bandwidth, is measured,
#: and a tiny ``rows`` would spend minutes building millions of them
MAX_GEMV_MATRICES = 4096


def measure_gemv(dtype: torch.dtype, total_bytes: int = 512 << 20, rows: int = 2048, repeats: int = 5) -> float:
    """Bytes/s of y = W x over square [rows, rows] matrices totalling ``total_bytes`` (≫ L3 cache),
    one after another as a model's layers are read, from 2 MiB pages as the engine keeps its weights
    (kvserve/memory.py). ValueError: rows, total_bytes or repeats not an integer >= 1; more than
    ``MAX_GEMV_MATRICES`` matrices (rows too small for total_bytes); or two matrices over total_bytes (rows
    too large for it)."""
    _check_positive_ints(rows=rows, total_bytes=total_bytes, repeats=repeats)
    elem = torch.empty((), dtype=dtype).element_size()
    if 2 * rows * rows * elem > total_bytes:
        raise ValueError(f"rows={rows}: two matrices take {2 * rows * rows * elem} B, more than total_bytes="
                         f"{total_bytes}; use rows <= {math.isqrt(total_bytes // (2 * elem))} "
                         f"(or a larger total_bytes)")
    n = total_bytes // (rows * rows * elem)
    if n > MAX_GEMV_MATRICES:
        # the smallest r with total_bytes // (r² · elem) <= MAX, i.e. r² · elem · (MAX + 1) > total_bytes
        least = math.isqrt(total_bytes // ((MAX_GEMV_MATRICES + 1) * elem)) + 1
        raise ValueError(f"rows={rows} needs {n} matrices of {rows * rows * elem} B for total_bytes={total_bytes}; "
                         f"at most {MAX_GEMV_MATRICES}: use rows >= {least} (or a smaller total_bytes)")
    mats = _random_in_huge_pages([(rows, rows)] * n, dtype)  # as the engine's
    x = torch.randn(1, rows).to(dtype)

    def run():
        for w in mats:
            torch.nn.functional.linear(x, w)

    return sum(w.numel() * w.element_size() for w in mats) / _best_time(run, repeats)


def _model_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every nn.Linear weight and the LM head (the embedding table when tied), in layer order."""
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        mats.append(model.embed_tokens.weight)  # tied LM head
    return mats


def _time_model_matrices(model: torch.nn.Module, rows: int, repeats: int) -> tuple[list[torch.Tensor], float]:
    """(the matrices, best seconds of one pass of Y = X Wᵀ over all of them with ``rows`` rows of X)."""
    mats = _model_matrices(model)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in mats}

    @torch.inference_mode()
    def run():
        for w in mats:
            linear(xs[w.shape[1]], w)  # the engine's dispatch: kvserve's GEMV for a decode step's rows

    return mats, _best_time(run, repeats)


def measure_model_gemv(model: torch.nn.Module, repeats: int = 5) -> float:
    """Bytes/s of y = W x over a model's own matrices (every nn.Linear and the LM head, in layer
    order, as a decode step reads them) with a one-row x. Small matrices (SmolLM2's are 576 wide)
    stream slower than the large square ones of :func:`measure_gemv`; ``kvserve explain`` uses this
    rate for the model it explains."""
    mats, t = _time_model_matrices(model, 1, repeats)
    return sum(w.numel() * w.element_size() for w in mats) / t


def measure_model_matmul(model: torch.nn.Module, rows: int, repeats: int = 2) -> float:
    """FLOP/s of Y = X Wᵀ over a model's own matrices (every nn.Linear and the LM head) with ``rows``
    rows of X, as a prefill chunk of ``rows`` tokens multiplies them: 2 · rows · Σ N·K FLOPs. SmolLM2's
    576-wide matrices run well below a 2048² GEMM's rate, more so for short chunks; ``kvserve explain``
    predicts each context's TTFT at the rate of its own chunk size."""
    mats, t = _time_model_matrices(model, rows, repeats)
    return 2 * rows * sum(w.numel() for w in mats) / t


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an [n, n] × [n, n] GEMM: 2n³ FLOPs."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _best_time(lambda: a @ b, repeats)


#: measure_kv_read's least growth of time from the shorter context to the longer one (a fraction)
MIN_KV_READ_GROWTH = 0.1


def measure_kv_read(dtype: torch.dtype, num_layers: int = 30, num_kv_heads: int = 3, head_dim: int = 64,
                    num_heads: int = 9, contexts: tuple[int, int] = (256, 4096), repeats: int = 5) -> float:
    """Marginal K+V bytes/s of the engine's paged decode attention for one sequence, over
    ``num_layers`` separate caches (so they do not all fit in L3), between two context lengths.
    Default shape: the bundled SmolLM2's heads (9 query / 3 KV × 64).
    ValueError: contexts not two integers 1 <= a < b, a shape argument or repeats not an integer >= 1,
    num_heads not a multiple of num_kv_heads, or caches over half this machine's memory. ProbeError (a
    RuntimeError): the longer context took less than ``MIN_KV_READ_GROWTH`` more time than the shorter
    one. Then something other than reading the KV bytes set both times (another process holding a core
    while libgomp spins, or contexts too close), and their difference gives no rate (a busy host's 28 ms
    against 28 ms gave 983 GB/s)."""
    from kvserve.attention.metadata import AttentionMetadata
    from kvserve.attention.paged import paged_attention

    _check_positive_ints(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_heads=num_heads, repeats=repeats)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if (not isinstance(contexts, (tuple, list)) or len(contexts) != 2
            or any(isinstance(c, bool) or not isinstance(c, int) for c in contexts)
            or not 1 <= contexts[0] < contexts[1]):
        raise ValueError(f"contexts must be two integers 1 <= a < b, got {contexts!r}")
    bs = 16
    nb = -(-contexts[1] // bs)  # every token of the longer context has a slot
    elem = torch.empty((), dtype=dtype).element_size()
    cache_bytes, memory_bytes = 2 * num_layers * nb * bs * num_kv_heads * head_dim * elem, _total_memory_bytes()
    if memory_bytes and cache_bytes > memory_bytes / 2:
        raise ValueError(f"contexts[1]={contexts[1]} with {num_layers} layers needs {cache_bytes / 2**30:.1f} GiB "
                         f"of KV cache, over half of {memory.memory_limit()[1]} ({memory_bytes / 2**30:.1f} GiB)")
    flat = _random_in_huge_pages([(nb, bs, num_kv_heads, head_dim)] * (2 * num_layers), dtype)  # as the engine's
    caches = list(zip(flat[0::2], flat[1::2]))
    q = torch.randn(1, num_heads, head_dim).to(dtype)
    kv = torch.randn(1, num_kv_heads, head_dim).to(dtype)
    times = []
    for ctx in contexts:
        meta = AttentionMetadata.build([list(range(nb))], [ctx - 1], [1], bs)

        def run():
            for kc, vc in caches:
                paged_attention(q, kv, kv, kc, vc, meta, head_dim ** -0.5)

        times.append(_best_time(run, repeats))
    per_token = 2 * num_layers * num_kv_heads * head_dim * elem
    if times[1] < times[0] * (1 + MIN_KV_READ_GROWTH):
        raise ProbeError(
            f"measure_kv_read: {contexts[1]} tokens took {times[1] * 1e3:.3f} ms, less than "
            f"{MIN_KV_READ_GROWTH:.0%} more than {contexts[0]} tokens' {times[0] * 1e3:.3f} ms, so the KV read did "
            f"not set these times and no rate follows. If another process is busy, measure with one thread "
            f"(OMP_NUM_THREADS=1) or OMP_WAIT_POLICY=PASSIVE; otherwise use contexts further apart")
    return (contexts[1] - contexts[0]) * per_token / (times[1] - times[0])


def measure_engine_overhead(dtype: str, layer_counts: tuple[int, int] = (2, 30), steps: int = 24,
                            like: ModelConfig | None = None) -> tuple[float, float]:
    """(constant s per step, s per layer) of the engine's decode step on models of width 64 (bytes and
    FLOPs negligible), from the median ITL at two layer counts. ``like``: keep that model's attention
    shape (heads, KV heads, head_dim) and only shrink hidden/intermediate/vocab, so the per-layer ops
    (RoPE, cache writes, attention, norms) run at the explained model's head shapes."""
    from kvserve.llm import LLM
    from kvserve.models.catalog import DUMMY_PRESETS
    from kvserve.sampling_params import SamplingParams

    itl = []
    for n in layer_counts:
        base = DUMMY_PRESETS["tiny-llama"] if like is None else like.replace(
            hidden_size=64, intermediate_size=64, vocab_size=1024, tie_word_embeddings=True,
            max_position_embeddings=max(like.max_position_embeddings, 512))
        cfg = base.replace(num_layers=n, name=f"overhead-probe-{n}")
        llm = LLM("tiny-llama", load_format="dummy", dtype=dtype, dummy_config=cfg, progress=False,
                  kv_cache_memory="64MiB", max_model_len=512)
        sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate([[100] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        runs = [llm.generate([[100 + i] * 32], sp)[0].outputs[0].latency for i in range(3)]
        itl.append(min(r.percentile_itl_ms(50) for r in runs) / 1e3)
    per_layer = max(0.0, (itl[1] - itl[0]) / (layer_counts[1] - layer_counts[0]))
    return max(0.0, itl[0] - per_layer * layer_counts[0]), per_layer


def run_probe(dtypes: tuple[str, ...] = ("float32", "bfloat16"), dtype: str = "float32",
              engine_overhead: bool = True) -> ProbeResult:
    """Measure everything above for each compute dtype; ``dtype`` is the one ``local`` plans with."""
    res = ProbeResult(torch.get_num_threads(), _total_memory_bytes(), dtype=dtype)
    for name in dtypes:
        td = getattr(torch, name)
        res.gemv_bytes_per_s[name] = measure_gemv(td)
        res.matmul_flops[name] = measure_matmul(td)
        res.kv_read_bytes_per_s[name] = measure_kv_read(td)
    if engine_overhead:
        res.step_overhead_s, res.overhead_per_layer_s = measure_engine_overhead(dtype)
    res.engine_overhead_measured = engine_overhead
    return res


def _total_memory_bytes() -> float:
    try:
        return float(memory.memory_limit_bytes())
    except (ValueError, OSError):  # sysconf names this OS lacks
        return 0.0


def save_probe(res: ProbeResult, path: str | None = None) -> str:
    path = path or probe_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(res), f, indent=2)
    os.replace(tmp, path)
    return path


def load_probe(path: str | None = None) -> ProbeResult:
    """The saved probe; ConfigError telling the user to run ``kvserve probe`` when there is none."""
    path = path or probe_path()
    if not os.path.isfile(path):
        raise ConfigError(f"no probe of this machine at {path}; run `kvserve probe` first")
    with open(path) as f:
        return ProbeResult(**json.load(f))


def format_probe(res: ProbeResult) -> str:
    lines = [f"kvserve probe — {res.num_threads} threads, {res.memory_bytes / 2**30:.1f} GiB memory"]
    for d in res.gemv_bytes_per_s:
        lines.append(f"  {d:>9}: weights (GEMV) {res.gemv_bytes_per_s[d] / 1e9:6.1f} GB/s   "
                     f"KV (decode attention) {res.kv_read_bytes_per_s[d] / 1e9:6.1f} GB/s   "
                     f"matmul {res.matmul_flops[d] / 1e9:7.1f} GFLOP/s")
    if res.engine_overhead_measured:
        lines.append(f"  engine overhead: {res.step_overhead_s * 1e3:.2f} ms per step + "
                     f"{res.overhead_per_layer_s * 1e3:.3f} ms per layer (measured on width-64 models)")
    else:
        lines.append("  engine overhead: not measured (--no-engine); plans on this probe count none")
    return "\n".join(lines)

