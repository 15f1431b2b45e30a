"""Fit the planner's efficiency factors per hardware class to public measurements, and report
predicted vs public for each. ``python -m kvserve.planner.calibrate --write`` rewrites
``kvserve/planner/calibration.json`` (read by :func:`kvserve.planner.hardware.load_calibration`);
tests re-run the fit and check every prediction is within ±25 % of its measurement.

Fit: minimise Σ log²(predicted / public) over a grid, decode factors (bandwidth efficiency, per-step
overhead, all-reduce hop latency) on the ITL rows, then the FLOP/s efficiency on the TTFT rows.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import asdict, dataclass, replace

from kvserve.planner.cost import Workload, decode_step, plan
from kvserve.planner.hardware import CALIBRATION_PATH, HARDWARE, Efficiency
from kvserve.planner.models import get_model


@dataclass(frozen=True)
class PublicMeasurement:
    """A published figure: ``metric`` "itl" (ms per decode step) or "ttft" (ms) of ``model`` on
    ``hardware`` for ``workload``. KV caches are taken as 16-bit (the sources do not state an fp8 KV
    cache; at these contexts the KV term is < 3 % of a step either way)."""

    name: str
    source: str
    model: str
    hardware: str
    workload: Workload
    metric: str
    value_ms: float


_GPT_FAST = "github.com/pytorch-labs/gpt-fast README (benchmarks table; A100-80GB power-capped to 330 W)"
_NIM = "docs.nvidia.com/nim/benchmarking/llm (Llama-3.3-70B-Instruct FP8, 2×H100 SXM TP2, concurrency 1)"
_VLLM = "perf.vllm.ai nightly latency benchmarks (H200, input 32 / output 128, batch 8)"
_TRT = "nvidia.github.io/TensorRT-LLM/performance (LLaMA-7B, batch 1, input 2048: first-token latency)"

MEASUREMENTS: tuple[PublicMeasurement, ...] = (
    PublicMeasurement("llama-3.1-8b bf16 A100 b1", _GPT_FAST, "llama-3.1-8b", "a100-80gb-sxm",
                      Workload(8, 200, 1, 1, "bf16", "bf16"), "itl", 10.65),
    PublicMeasurement("llama-3.1-70b int8 A100 b1", _GPT_FAST, "llama-3.1-70b", "a100-80gb-sxm",
                      Workload(8, 200, 1, 1, "int8", "bf16"), "itl", 55.4),
    PublicMeasurement("llama-3.1-70b bf16 A100 TP4", _GPT_FAST, "llama-3.1-70b", "a100-80gb-sxm",
                      Workload(8, 200, 1, 4, "bf16", "bf16"), "itl", 26.7),
    PublicMeasurement("llama-3.1-70b bf16 A100 TP8", _GPT_FAST, "llama-3.1-70b", "a100-80gb-sxm",
                      Workload(8, 200, 1, 8, "bf16", "bf16"), "itl", 17.0),
    PublicMeasurement("llama-7b fp16 A100 TTFT 2048", _TRT, "llama-7b", "a100-80gb-sxm",
                      Workload(2048, 1, 1, 1, "fp16", "fp16"), "ttft", 132.0),
    PublicMeasurement("llama-3.3-70b fp8 H100 TP2 ITL", _NIM, "llama-3.3-70b", "h100-sxm",
                      Workload(5000, 500, 1, 2, "fp8", "bf16"), "itl", 18.6),
    PublicMeasurement("llama-3.3-70b fp8 H100 TP2 TTFT", _NIM, "llama-3.3-70b", "h100-sxm",
                      Workload(5000, 500, 1, 2, "fp8", "bf16"), "ttft", 407.0),
    PublicMeasurement("llama-3-70b bf16 H200 TP4 b8", _VLLM, "llama-3-70b", "h200",
                      Workload(32, 128, 8, 4, "bf16", "bf16"), "itl", 16.2),
    PublicMeasurement("llama-3.1-8b bf16 H200 b8", _VLLM, "llama-3.1-8b", "h200",
                      Workload(32, 128, 8, 1, "bf16", "bf16"), "itl", 6.5),
    PublicMeasurement("llama-7b fp8 H100 TTFT 2048", _TRT, "llama-7b", "h100-sxm",
                      Workload(2048, 1, 1, 1, "fp8", "bf16"), "ttft", 30.8),
)


def predict_ms(m: PublicMeasurement, eff: Efficiency) -> float:
    """The planner's figure for ``m`` with factors ``eff`` (ITL: the mean decode step)."""
    shape, hw, w = get_model(m.model), HARDWARE[m.hardware], m.workload
    if m.metric == "itl":
        return decode_step(shape, hw, eff, w, w.prompt_tokens + w.output_tokens / 2).time_s * 1e3
    return plan(shape, hw, eff, w).ttft_ms


def _loss(rows: list[PublicMeasurement], eff: Efficiency) -> float:
    return sum(math.log(predict_ms(m, eff) / m.value_ms) ** 2 for m in rows)


def _grid(lo: float, hi: float, step: float) -> list[float]:
    return [round(lo + i * step, 10) for i in range(int(round((hi - lo) / step)) + 1)]


def _fit_decode(rows: list[PublicMeasurement], base: Efficiency) -> Efficiency:
    """Coarse grid, then a fine grid around the best, over (bandwidth eff., overhead, hop latency)."""
    if not rows:
        return base
    spans = [(0.30, 1.00, 0.05), (0.0, 3e-3, 0.5e-3), (0.0, 10e-6, 2e-6)]
    best = base
    for _ in range(2):
        grids = [_grid(max(lo, 0.0), hi, st) for lo, hi, st in spans]
        cands = (replace(base, bandwidth_efficiency=b, step_overhead_s=o, allreduce_hop_latency_s=h)
                 for b, o, h in itertools.product(*grids))
        best = min(cands, key=lambda e: _loss(rows, e))
        centre = (best.bandwidth_efficiency, best.step_overhead_s, best.allreduce_hop_latency_s)
        spans = [(c - st, c + st, st / 5) for c, (_, _, st) in zip(centre, spans)]
    return best


def _fit_flops(rows: list[PublicMeasurement], base: Efficiency) -> Efficiency:
    if not rows:
        return base
    return min((replace(base, flops_efficiency=f) for f in _grid(0.10, 1.00, 0.01)), key=lambda e: _loss(rows, e))


def fit_class(hardware_class: str) -> Efficiency:
    """Efficiency factors of one hardware class fitted to its measurements."""
    rows = [m for m in MEASUREMENTS if HARDWARE[m.hardware].hardware_class == hardware_class]
    names = ", ".join(m.name for m in rows)
    eff = _fit_decode([m for m in rows if m.metric == "itl"], Efficiency(calibrated_on=names))
    return _fit_flops([m for m in rows if m.metric == "ttft"], eff)


def calibrate() -> dict:
    """{"classes": {class: Efficiency fields}, "rows": [predicted vs public per measurement]}."""
    classes = sorted({HARDWARE[m.hardware].hardware_class for m in MEASUREMENTS})
    fitted = {c: fit_class(c) for c in classes}
    rows = []
    for m in MEASUREMENTS:
        pred = predict_ms(m, fitted[HARDWARE[m.hardware].hardware_class])
        rows.append({"name": m.name, "metric": m.metric, "public_ms": m.value_ms, "predicted_ms": round(pred, 3),
                     "error_pct": round(100 * (pred / m.value_ms - 1), 1), "source": m.source})
    return {"classes": {c: asdict(e) for c, e in fitted.items()}, "rows": rows}


def format_table(result: dict) -> str:
    lines = ["class      bandwidth_eff  flops_eff  step_overhead_ms  allreduce_hop_us"]
    for c, e in result["classes"].items():
        lines.append(f"{c:<10} {e['bandwidth_efficiency']:>13.3f} {e['flops_efficiency']:>10.2f} "
                     f"{e['step_overhead_s'] * 1e3:>17.2f} {e['allreduce_hop_latency_s'] * 1e6:>17.2f}")
    lines += ["", f"{'measurement':<34} {'metric':>6} {'public ms':>10} {'predicted':>10} {'error':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['name']:<34} {r['metric']:>6} {r['public_ms']:>10.2f} {r['predicted_ms']:>10.2f} "
                     f"{r['error_pct']:>+6.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite {CALIBRATION_PATH}")
    a = p.parse_args(argv)
    result = calibrate()
    print(format_table(result))
    if a.write:
        with open(CALIBRATION_PATH, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"\nwrote {CALIBRATION_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
