"""``kvserve explain``: run real generations here at several contexts and put the measured TTFT and
ITL beside the planner's prediction for the same work on ``local`` (rates from ``kvserve probe``),
with the engine's own byte accounting (its StepStats) checked against the planner's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvserve.bench.latency import random_prompt
from kvserve.planner.cost import Workload, plan
from kvserve.planner.probe import ProbeResult
from kvserve.planner.shapes import ModelShape
from kvserve.sampling_params import SamplingParams

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
                "float8_e5m2": "fp8", "int8": "int8"}


@dataclass
class ExplainRow:
    """One context: measured (engine) vs predicted (planner) figures, ms and bytes per decode step."""

    context_tokens: int
    measured_ttft_ms: float
    predicted_ttft_ms: float
    measured_itl_ms: float
    predicted_itl_ms: float
    engine_bytes_per_step: float
    planner_bytes_per_step: float

    @property
    def itl_error_pct(self) -> float:
        return 100 * (self.predicted_itl_ms / self.measured_itl_ms - 1)

    @property
    def ttft_error_pct(self) -> float:
        return 100 * (self.predicted_ttft_ms / self.measured_ttft_ms - 1)


def engine_workload(llm, context_tokens: int, output_tokens: int) -> tuple[ModelShape, Workload]:
    """The planner's view of what ``llm``'s engine runs: its shape, dtypes and prefill chunk size."""
    eng = llm.engine
    shape = ModelShape.from_model_config(eng.model_config, eng.model_name)
    wd = _DTYPE_NAMES[str(eng.dtype).removeprefix("torch.")]
    kd = _DTYPE_NAMES[str(eng.kv_spec.dtype).removeprefix("torch.")]
    chunk = eng.config.scheduler.max_num_batched_tokens
    packed = any(eng.weight_kinds.get(k, 0) > 0 for k in ("int4", "int8"))
    per_param = eng.weight_bytes_per_step / shape.params_read_per_step(1) if packed else 0.0  # int4/int8 mix
    return shape, Workload(context_tokens, output_tokens, 1, 1, wd, kd, chunk_tokens=chunk,
                           weight_bytes_per_param=per_param)


def measure_context(llm, context_tokens: int, output_tokens: int) -> tuple[float, float, float]:
    """(TTFT ms without tokenization, mean ITL ms, mean bytes per decode step (forward pass) from StepStats)."""
    eng = llm.engine
    prompt = random_prompt(context_tokens, eng.vocab_size, seed=context_tokens)
    first = eng.num_steps + 1
    sp = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    lat = llm.generate([prompt], sp)[0].outputs[0].latency
    decode = [s for s in eng.step_stats if s.step >= first and s.is_decode_only]
    per_pass = sum(s.total_bytes for s in decode) / sum(s.num_steps for s in decode) if decode else 0.0
    return lat.ttft_ms - lat.tokenize_ms, lat.mean_itl_ms, per_pass


def run_explain(llm, probe: ProbeResult, contexts: list[int], output_tokens: int,
                matmul_flops_at=None) -> list[ExplainRow]:
    """Measure each context (after one warm-up) and predict it on ``local`` from ``probe``.
    ``matmul_flops_at(rows)``: FLOP/s of the model's matmuls for a prefill chunk of ``rows`` tokens
    (e.g. :func:`kvserve.planner.probe.measure_model_matmul`); default: the probe's square-GEMM rate."""
    hw, eff = probe.hardware(), probe.efficiency()
    llm.generate([random_prompt(16, llm.engine.vocab_size, 0)], SamplingParams(max_tokens=4, ignore_eos=True))
    chunk = llm.engine.config.scheduler.max_num_batched_tokens
    rows = []
    for ctx in contexts:
        ttft, itl, engine_bytes = measure_context(llm, ctx, output_tokens)
        shape, w = engine_workload(llm, ctx, output_tokens)
        hw_ctx = hw if matmul_flops_at is None else replace(hw, bf16_flops=matmul_flops_at(min(ctx, chunk)))
        p = plan(shape, hw_ctx, eff, w)
        rows.append(ExplainRow(ctx, ttft, p.ttft_ms, itl, p.itl_ms, engine_bytes,
                               p.decode_mean.weight_bytes + p.decode_mean.kv_bytes))
    return rows


def format_explain(rows: list[ExplainRow], probe: ProbeResult, model: str) -> str:
    e = probe.efficiency()
    d = probe.dtype
    lines = [f"kvserve explain — {model} ({d}), batch 1, on this machine as probed: weights "
             f"{probe.gemv_bytes_per_s[d] / 1e9:.1f} GB/s, KV {probe.kv_read_bytes_per_s[d] / 1e9:.1f} GB/s, "
             f"matmul {probe.matmul_flops[d] / 1e9:.0f} GFLOP/s, overhead {e.step_overhead_s * 1e3:.2f} ms/step + "
             f"{e.overhead_per_layer_s * 1e3:.3f} ms/layer",
             f"{'context':>8} {'TTFT meas':>10} {'TTFT pred':>10} {'err':>7} {'ITL meas':>9} {'ITL pred':>9} {'err':>7} "
             f"{'MB/step engine':>15} {'planner':>8}"]
    for r in rows:
        lines.append(f"{r.context_tokens:>8} {r.measured_ttft_ms:>10.1f} {r.predicted_ttft_ms:>10.1f} "
                     f"{r.ttft_error_pct:>+6.1f}% {r.measured_itl_ms:>9.2f} {r.predicted_itl_ms:>9.2f} "
                     f"{r.itl_error_pct:>+6.1f}% {r.engine_bytes_per_step / 1e6:>15.1f} "
                     f"{r.planner_bytes_per_step / 1e6:>8.1f}")
    return "\n".join(lines)


def plot_explain(rows: list[ExplainRow], llm, probe: ProbeResult, output_tokens: int, path: str) -> str:
    """ITL vs context: the planner's line, the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hw, eff = probe.hardware(), probe.efficiency()
    top = max(r.context_tokens for r in rows)
    xs = sorted({int(top * f / 32) for f in range(1, 33)} | {r.context_tokens for r in rows})
    ys = []
    for x in xs:
        shape, w = engine_workload(llm, x, output_tokens)
        ys.append(plan(shape, hw, eff, w).itl_ms)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, ys, "-", label="predicted (planner, local probe)")
    ax.plot([r.context_tokens for r in rows], [r.measured_itl_ms for r in rows], "o", label="measured (engine)")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ITL ms (batch 1)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rows_as_dicts(rows: list[ExplainRow]) -> list[dict]:
    return [{**asdict(r), "itl_error_pct": r.itl_error_pct, "ttft_error_pct": r.ttft_error_pct} for r in rows]
