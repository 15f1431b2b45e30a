"""Scale granularity of the quantized KV cache, measured on a real model's K/V (``python -m
kvserve.eval.granularity``): per (token, KV head) vector — what kv_quant uses — against one scale per
layer tensor (max|x| over the whole layer's K or V: an oracle calibration, the best a static
per-tensor scale can do). Reports the relative RMS error of K and V, the error of one decode query's
attention output against float32, and the time to quantize and to dequantize."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvserve.attention.kv_quant import QUANT_KINDS, dequantize, quantize


def capture_kv(llm, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``ids`` as one prompt and return each layer's new (K, V): [len, Hkv, d] float32."""
    import kvserve.models.llama as llama

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    orig = llama.write_kv

    def record(kc, vc, k, v, slots):
        seen.append((k.detach().float().clone(), v.detach().float().clone()))
        return orig(kc, vc, k, v, slots)

    llama.write_kv = record
    try:
        from kvserve.sampling_params import SamplingParams

        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    finally:
        llama.write_kv = orig
    return seen


def quantize_per_tensor(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, qmax = QUANT_KINDS[kind]
    scale = (x.abs().amax() / qmax).clamp_min(1e-12).expand(x.shape[:-1])
    dtype = QUANT_KINDS[kind][0]
    y = x / scale[..., None]
    codes = y.round().clamp(-127, 127).to(torch.int8) if kind == "int8" else y.clamp(-qmax, qmax).to(dtype)
    return codes.view(torch.uint8), scale


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def _attn_err(k, v, kq, vq, H: int) -> float:
    """Relative RMS error of the last token's attention output (query = that token's key, G heads)."""
    S, Hkv, d = k.shape
    q = k[-1].repeat_interleave(H // Hkv, 0)[None, :, None, :].transpose(0, 1)  # [H, 1, 1, d]
    ref = F.scaled_dot_product_attention(q, k.transpose(0, 1).repeat_interleave(H // Hkv, 0)[:, None],
                                         v.transpose(0, 1).repeat_interleave(H // Hkv, 0)[:, None])
    got = F.scaled_dot_product_attention(q, kq.transpose(0, 1).repeat_interleave(H // Hkv, 0)[:, None],
                                         vq.transpose(0, 1).repeat_interleave(H // Hkv, 0)[:, None])
    return _rel_rms(got, ref)


def _time_ms(f, n: int = 10) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def measure(layers, num_heads: int) -> list[dict]:
    rows = []
    for kind in QUANT_KINDS:
        for name, qfn in (("per-vector", quantize), ("per-tensor", quantize_per_tensor)):
            ek, ev, ea = [], [], []
            for k, v in layers:
                kq = dequantize(*qfn(k, kind), kind)
                vq = dequantize(*qfn(v, kind), kind)
                ek.append(_rel_rms(kq, k))
                ev.append(_rel_rms(vq, v))
                ea.append(_attn_err(k, v, kq, vq, num_heads))
            k0 = layers[0][0]
            codes, scale = qfn(k0, kind)
            rows.append({"kind": kind, "granularity": name, "k_rel_rms": sum(ek) / len(ek),
                         "v_rel_rms": sum(ev) / len(ev), "attn_rel_rms": sum(ea) / len(ea),
                         "attn_rel_rms_worst_layer": max(ea),
                         "quantize_ms": _time_ms(lambda: qfn(k0, kind)),
                         "dequantize_ms": _time_ms(lambda: dequantize(codes, scale, kind))})
    return rows


def main() -> None:
    from kvserve.eval.ppl import corpus_text
    from kvserve.llm import LLM

    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", progress=False, max_model_len=2048, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(corpus_text(), add_special_tokens=False)[:1024]
    layers = capture_kv(llm, ids)
    print(f"SmolLM2-135M K/V of {len(ids)} tokens x {len(layers)} layers; 1-thread timings on one layer's K")
    print(f"{'kind':<9} {'granularity':<11} {'K relRMS':>9} {'V relRMS':>9} {'attn relRMS':>11} {'worst layer':>11} "
          f"{'quant ms':>8} {'dequant ms':>10}")
    for r in measure(layers, llm.engine.model_config.num_heads):
        print(f"{r['kind']:<9} {r['granularity']:<11} {r['k_rel_rms']:>9.4f} {r['v_rel_rms']:>9.4f} "
              f"{r['attn_rel_rms']:>11.4f} {r['attn_rel_rms_worst_layer']:>11.4f} {r['quantize_ms']:>8.2f} "
              f"{r['dequantize_ms']:>10.2f}")


if __name__ == "__main__":
    main()
