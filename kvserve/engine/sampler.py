"""Logits processors and per-request seeded sampling for one batch of logits rows.

Order (as in vLLM): logit_bias → min_tokens suppression → repetition penalty → presence/frequency penalties →
greedy argmax, or temperature → top-k → top-p → min-p → inverse-CDF sampling with each row's
own ``torch.Generator``. Logprobs are always those of the RAW logits, before any processor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.attention import kv_quant_kernel
from kvserve.outputs import TokenLogprobs
from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits batch.

    ``generator``: the request's own RNG (seeded requests) on the logits' device, or ``None`` to draw
    from torch's global RNG. ``eos_token_ids``: the tokens the engine treats as end-of-sequence; they
    are set to -inf (together with ``params.stop_token_ids``) while
    ``len(output_token_ids) < params.min_tokens``, whatever ``params.ignore_eos`` says — pass ``()``
    to leave EOS alone.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs (``None`` where ``params.logprobs is None``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless: ``Sampler()(logits, rows)`` → :class:`SamplerOutput`."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_rows, vocab_size]``, float32 or bfloat16 (cast to float32), any device.
            rows: ``num_rows`` rows, in the order of ``logits``.
        Returns:
            :class:`SamplerOutput`; greedy rows (``params.greedy``) take the argmax of the processed
            logits, ties broken by the lowest token id.
        Raises:
            ValueError: ``logits`` is not 2-D or its row count differs from ``len(rows)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab_size], got {tuple(logits.shape)}")
        if all(plain_greedy(r, logprobs=True) for r in rows):  # the common decode step: one argmax
            ids = greedy_token_ids(logits)
            return SamplerOutput(token_ids=ids, logprobs=compute_logprobs(logits, ids, rows))
        u = None
        if all(plain_sampled(r, logprobs=True) for r in rows) and sampling_kernel(logits) is not None:
            # the common sampled decode step: no processors, on the kernel
            u = draw_uniforms([r.generator for r in rows])
            ids = sample_plain_rows(logits, list(range(len(rows))), [r.params for r in rows], u)
            if min(ids) >= 0:  # -1: a NaN or all -inf row, decided below with the same u
                return SamplerOutput(token_ids=ids, logprobs=compute_logprobs(logits, ids, rows))
        raw = logits.float()  # the processors below change their input: raw stays for the logprobs
        in_place = any(r.params.processes_logits or len(r.output_token_ids) < r.params.min_tokens for r in rows)
        processed = apply_penalties(apply_min_tokens(apply_logit_bias(raw.clone() if in_place else raw, rows), rows),
                                    rows)
        ids = [-1] * len(rows)  # a list, not a tensor: indexed tensor stores cost ~10-20 µs each
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:  # first max = lowest id on ties
            for i, t in zip(greedy, greedy_token_ids(processed if len(greedy) == len(rows) else processed[greedy])):
                ids[i] = t
        if sampled:
            if u is None:
                u = draw_uniforms([rows[i].generator for i in sampled])
            if sampling_kernel(processed) is not None:
                drawn = sample_plain_rows(processed, sampled, [rows[i].params for i in sampled], u)
                for j, t in enumerate(drawn):
                    if t >= 0:  # -1: a NaN or all -inf row, decided below
                        ids[sampled[j]] = t
                left = [j for j, t in enumerate(drawn) if t < 0]
                sampled, u = [sampled[j] for j in left], u[left]
        if sampled:
            sub_rows = [rows[i] for i in sampled]
            probs = sampling_probs(processed if len(sampled) == len(rows) else processed[sampled],
                                   [r.params for r in sub_rows])
            for i, t in zip(sampled, sample_from_probs(probs, [r.generator for r in sub_rows], u).tolist()):
                ids[i] = t
        return SamplerOutput(token_ids=ids, logprobs=compute_logprobs(raw, ids, rows))


def sampling_kernel(logits: torch.Tensor):
    """The kernel library (``kvs_argmax_rows``, ``kvs_sample_rows``) where it takes ``logits``: float32 or
    bfloat16 on the CPU, fewer than 2^31 entries a row (the argmax's lane indices are int32); else None."""
    if logits.device.type != "cpu" or logits.dtype not in _ARGMAX_CODES or not 0 < logits.shape[1] < 2 ** 31:
        return None
    return kv_quant_kernel.load()


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as ``torch.max(logits, dim=-1).indices`` gives it: the first maximum (lowest id
    on ties), or the first NaN of a row that has one. ``logits``: [num_rows, vocab] float32 or bfloat16.
    On the CPU the kernel's ``kvs_argmax_rows`` (one 49,152-entry row: torch's max ~90 µs, 2-3 % of a
    SmolLM2 decode step); elsewhere, or without the kernel, torch's max (max, not argmax: the same
    indices in 1/3 to 1/5 of argmax's time on the CPU)."""
    dll = sampling_kernel(logits)
    if dll is None:
        return logits.max(dim=-1).indices.tolist()
    x = logits.resolve_neg().contiguous()  # a negated view's values, not its storage's
    out = torch.empty(x.shape[0], dtype=torch.int64)
    dll.kvs_argmax_rows(x.data_ptr(), _ARGMAX_CODES[x.dtype], x.shape[0], x.shape[1], out.data_ptr())
    return out.tolist()


_ARGMAX_CODES = {torch.float32: 3, torch.bfloat16: 4}


def plain_sampled(row: SamplingRow, logprobs: bool = False) -> bool:
    """Sampled (temperature, top-k, top-p, min-p) with no logprobs (``logprobs``: asking for them
    allowed), processors or min_tokens left, so ``kvs_sample_rows`` can draw from the raw logits."""
    p = row.params
    return (not p.greedy and (logprobs or p.logprobs is None) and not p.processes_logits
            and len(row.output_token_ids) >= p.min_tokens)


def plain_greedy(row: SamplingRow, logprobs: bool = False) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs (``logprobs``: asking for them
    allowed): the argmax of the raw logits (an exact cast to float32 keeps the argmax and its lowest-id
    tie break)."""
    p = row.params
    return (p.greedy and (logprobs or p.logprobs is None) and not p.processes_logits
            and len(row.output_token_ids) >= p.min_tokens)


# ---------------------------------------------------------------------------------------- processors
def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's ``params.logit_bias`` ({token id: bias}, OpenAI) to its logits.

    ``logits``: ``[num_rows, vocab]`` float32, modified in place and returned. Ids ≥ vocab are ignored
    (the engine rejects them when the request arrives).
    """
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab_size]
            if ids:
                logits[i, ids] += torch.tensor([float(bias[t]) for t in ids], dtype=logits.dtype, device=logits.device)
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set EOS and ``stop_token_ids`` to -inf in rows whose output is shorter than ``min_tokens``.

    ``logits``: ``[num_rows, vocab]`` float32, modified in place and returned. Ids ≥ vocab are ignored.
    """
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            banned = [t for t in (*row.eos_token_ids, *row.params.stop_token_ids) if t < vocab_size]
            if banned:
                logits[i, banned] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (CTRL) then presence/frequency (OpenAI) penalties, vectorised over rows.

    Repetition penalty ``p`` (Keskar et al. 2019, "CTRL", §4.1, with the sign fix used by HF/vLLM):
    for every token SEEN IN THE PROMPT OR THE OUTPUT, ``logit > 0 → logit / p``,
    ``logit < 0 → logit * p`` (so ``p > 1`` always makes a seen token less likely); ``p == 1`` is a no-op.
    Presence/frequency (OpenAI API): for tokens seen IN THE OUTPUT ONLY, with ``count`` occurrences,
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

    ``logits``: ``[num_rows, vocab]`` float32, modified in place and returned (on the CPU, by the kernel's
    ``kvs_apply_penalties``, which touches only the tokens each row has seen: the same float32
    operations; elsewhere, or for ids outside the vocabulary, by PyTorch over the whole rows, which may
    return a new tensor instead).
    """
    rep = [r.params.repetition_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    use_rep = any(p != 1.0 for p in rep)
    use_pf = any(p != 0.0 for p in pres) or any(f != 0.0 for f in freq)
    if not (use_rep or use_pf):
        return logits
    finfo = torch.finfo(torch.float32)  # a penalty that rounds to 0 or inf would make 0 * inf = NaN
    if _kernel_penalties(logits, rows, [min(max(p, finfo.tiny), finfo.max) for p in rep], pres, freq):
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    output_counts = token_counts([r.output_token_ids for r in rows], vocab_size, device)
    if use_rep:
        prompt_counts = token_counts([r.prompt_token_ids for r in rows], vocab_size, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        finfo = torch.finfo(logits.dtype)  # a penalty that rounds to 0 or inf would make 0 * inf = NaN
        penalty = torch.tensor(rep, dtype=torch.float64).clamp(finfo.tiny, finfo.max)
        penalty = penalty.to(device=device, dtype=logits.dtype).unsqueeze(1)  # [num_rows, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if use_pf:
        pres_t = torch.tensor(pres, dtype=logits.dtype, device=device).unsqueeze(1)
        freq_t = torch.tensor(freq, dtype=logits.dtype, device=device).unsqueeze(1)
        counts = output_counts.to(logits.dtype)
        logits = logits - freq_t * counts - pres_t * (counts > 0).to(logits.dtype)
    return logits


def _kernel_penalties(logits: torch.Tensor, rows: list[SamplingRow], rep: list[float], pres: list[float],
                      freq: list[float]) -> bool:
    """apply_penalties by ``kvs_apply_penalties`` in place; False (nothing changed) where it does not run:
    not a contiguous float32 CPU tensor, no kernel, or an id outside [0, vocab)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return False
    dll = kv_quant_kernel.load()
    if dll is None:
        return False
    n = logits.shape[1]
    ids = [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in rows]
    outs = [np.asarray(r.output_token_ids, dtype=np.int64) for r in rows]
    if any(a.size and (a.min() < 0 or a.max() >= n) for a in ids + outs):
        return False  # PyTorch's scatter raises on them, as before
    prompt_off = np.cumsum([0] + [a.size for a in ids], dtype=np.int64)
    out_off = np.cumsum([0] + [a.size for a in outs], dtype=np.int64)
    flat_p = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    flat_o = np.concatenate(outs) if outs else np.zeros(0, dtype=np.int64)
    f32 = [np.asarray(v, dtype=np.float32) for v in (rep, pres, freq)]
    return dll.kvs_apply_penalties(logits.data_ptr(), n, logits.shape[0], flat_p.ctypes.data, prompt_off.ctypes.data,
                                   flat_o.ctypes.data, out_off.ctypes.data, *(a.ctypes.data for a in f32)) == 0


def token_counts(id_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts ``[len(id_lists), vocab_size]`` int32 via one ``scatter_add_``.

    Rows are padded with the sentinel id ``vocab_size`` (an extra column, dropped at the end).
    Raises ``RuntimeError`` (from torch) on an id outside ``[0, vocab_size]``.
    """
    max_len = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max_len), vocab_size, dtype=torch.long)
    for i, ids in enumerate(id_lists):
        if ids:
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    counts = torch.zeros(len(id_lists), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.int32, device=device))
    return counts[:, :vocab_size]


# Rows with top-p but no top-k look for their nucleus among this many most likely tokens, then among
# the next size's; only a nucleus that reaches past the last (or a tie at the edge) sorts the whole
# vocabulary. Here, for 49,152 logits: topk(128) then ordering ~0.3 ms, topk(1024) ~0.9 ms, a full
# stable sort ~11 ms. SmolLM2 sampling 6 prompts × 96 tokens: nucleus p50 / p90 / max 4 / 45 / 654
# tokens at T 0.8, top-p 0.95; 57 / 823 / 6537 at T 1, top-p 0.95.
NUCLEUS_CANDIDATES = (128, 1024, 8192)
CDF_BLOCK = 256  # tokens per block of the two-level CDF search in sample_from_probs


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on non-greedy rows → probabilities ``[num_rows, vocab]``.

    Order by descending logit, ties lower id first: top-k keeps exactly ``k`` tokens (``k == 0``: off).
    Top-p (Holtzman et al. 2019, nucleus) keeps the smallest prefix of that order whose cumulative
    probability is ≥ ``top_p`` (always ≥ 1 token; ``top_p == 1``: off). Min-p keeps tokens with
    ``prob ≥ min_p × max prob``. Masked tokens get probability exactly 0; rows need not sum to 1.

    Cost: no sort where no row has top-k or top-p (a softmax); else ``topk`` over the candidates (the
    top ``k``, or :data:`NUCLEUS_CANDIDATES` for top-p alone), and a full stable sort only for rows
    whose nucleus may reach past them. (A full stable sort of a 49,152-token vocabulary cost 6-11 ms per
    row on this 2-core CPU: more than a SmolLM2 decode step.)
    """
    vocab_size = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = (logits / temperature.unsqueeze(1)).clamp_(max=torch.finfo(logits.dtype).max)  # inf breaks softmax
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    ranked = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if len(ranked) < len(params):  # temperature and min-p alone: a softmax, no order needed
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        if not ranked:
            return probs
    else:
        probs = torch.empty_like(logits)
    everyone = len(ranked) == len(params)  # no index copies of [rows, vocab] tensors then (~0.1 ms each)
    sub = logits if everyone else logits[ranked]
    sub_params, sub_min_p = [params[i] for i in ranked], min_p if everyone else min_p[ranked]
    got: torch.Tensor | None = None
    todo = list(range(len(ranked)))  # rows of sub not done yet
    for step, size in enumerate((*NUCLEUS_CANDIDATES, None)):
        # rows grouped by candidate count, so a row's arithmetic does not depend on the rest of the batch
        groups: dict[int | None, list[int]] = {}
        for i in todo:
            k = sub_params[i].top_k
            wanted = (min(k, vocab_size) + 1 if step == 0 else None) if k > 0 else size
            groups.setdefault(None if wanted is None or wanted >= vocab_size else wanted, []).append(i)
        todo = []
        for wanted, idx in groups.items():
            whole = idx == list(range(len(ranked)))  # every row, in order: sub itself
            rows, row_params, row_min_p = (sub, sub_params, sub_min_p) if whole else (
                sub[idx], [sub_params[i] for i in idx], sub_min_p[idx])
            if wanted is None:  # the whole vocabulary in order
                part, exact = _masked_probs(rows, *_order(rows), row_params, row_min_p), None
            else:
                part, exact = _masked_probs(rows, *_order(rows, wanted), row_params, row_min_p, candidates=True)
                todo += [i for i, ok in zip(idx, exact.tolist()) if not ok]
            if whole and got is None:
                got = part
            else:
                if got is None:
                    got = torch.empty_like(sub)
                got[idx] = part
        todo.sort()
        if not todo:
            break
    if everyone:
        return got
    probs[ranked] = got
    return probs


def _order(logits: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits per row (all when None) by (value descending, id ascending): [n, k] each."""
    if k is None:
        return logits.sort(dim=-1, descending=True, stable=True)
    return _sorted_topk(logits, k)


def _masked_probs(logits: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams],
                  min_p: torch.Tensor, candidates: bool = False):
    """Top-k, top-p and min-p over each row's first ``c`` tokens in order (``vals``/``ids`` [n, c]),
    scattered into zeros [n, vocab]. Without ``candidates`` they are the whole vocabulary; returns the
    probabilities. With it, returns (probabilities, exact) where ``exact[r]`` is False if row r's kept
    set ends on its candidates' lowest value: it may need tokens past them (a nucleus they do not fill,
    or a tie that goes on past them, where lower ids come first)."""
    device, c = logits.device, vals.shape[1]
    positions = torch.arange(c, device=device).unsqueeze(0)
    top_k = torch.tensor([min(p.top_k, c) if p.top_k > 0 else c for p in params], device=device).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    vals = vals.masked_fill(positions >= top_k, float("-inf"))
    # top-p over the top-k set, or over the whole vocabulary (all logits in the normaliser) without top-k;
    # exp(x − max) / Σ as softmax computes it (an m + log Σ normaliser rounds back to m for huge m)
    has_k = torch.tensor([p.top_k > 0 for p in params], device=device).unsqueeze(1)
    top = vals[:, :1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # an all -inf row: no NaN from inf − inf
    unnormalised = (vals - top).exp()
    total = unnormalised.sum(dim=-1, keepdim=True)
    if not bool(has_k.all()):  # a pass over the whole vocabulary only for rows without top-k
        total = torch.where(has_k, total, (logits - top).exp().sum(dim=-1, keepdim=True))
    cand_probs = unnormalised / total
    mass_before = cand_probs.cumsum(dim=-1) - cand_probs  # probability of strictly better tokens
    drop = (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    vals = vals.masked_fill(drop, float("-inf"))
    kept = vals.softmax(dim=-1)
    kept = kept.masked_fill(kept < min_p * kept[:, :1], 0.0)
    probs = torch.zeros_like(logits).scatter_(1, ids, kept)
    if not candidates:
        return probs
    # a kept set that reaches the last candidate (a nucleus the candidates do not fill) or a tie with it
    # (top-k + 1 candidates: a tie at the k-th token) may need tokens past them
    num_kept = (vals > float("-inf")).sum(dim=-1)  # kept by top-k and top-p (min-p only removes more)
    last_kept = vals.gather(1, (num_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return probs, last_kept > logits.gather(1, ids[:, -1:]).squeeze(1)


def draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One ``u ~ U[0, 1)`` per row, float64 ``[len(generators)]`` on the CPU: a seeded row's from its own
    generator, so its tokens do not depend on what else shares the batch; the unseeded rows' from torch's
    global RNG, in one draw."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(len(generators), dtype=torch.float64)
    u = torch.empty(len(generators), dtype=torch.float64)
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
    return u


def sample_plain_rows(logits: torch.Tensor, row_ids: list[int], params: list[SamplingParams],
                      u: torch.Tensor) -> list[int]:
    """Rows ``row_ids`` of ``logits`` ``[num_rows, vocab]`` with their temperature, top-k, top-p and min-p
    (``params``) drawn by the kernel's ``kvs_sample_rows`` (``sampling_kernel(logits)`` must not be None):
    the token :func:`sampling_probs` and :func:`sample_from_probs` draw for the same ``u`` (float64
    ``[len(row_ids)]``), up to rounding (the softmax's exp, probabilities left undivided by their sum; the
    top-p masses follow this module's float32 arithmetic, so a tie exactly at the top-p edge is cut
    alike). Returns one id per row, -1 for a row holding a NaN or only -inf (for the PyTorch path to
    decide). One 49,152-token row of random normal logits: ~0.05 ms at temperature 1, 0.12 ms with top-k
    40, 0.2-0.3 ms with top-k 1,000 or top-p 0.9 at a standard deviation of 3-8, 0.55-0.75 ms with top-p
    0.9-0.95 at 1 (a nucleus of ~20,000 tokens, radix-sorted; 4.6-9 ms by qsort), against 0.5-6.5 ms for
    the PyTorch ops on a decode step's cold caches (a SmolLM2 int4 step is ~4 ms)."""
    x = logits.resolve_neg().contiguous()
    n = len(row_ids)
    ids = np.asarray(row_ids, dtype=np.int64)
    temperature, top_k, top_p, min_p = sampling_arrays(params)
    uu = np.ascontiguousarray(u.numpy(), dtype=np.float64)
    out = np.empty(n, dtype=np.int64)
    sampling_kernel(x).kvs_sample_rows(x.data_ptr(), _ARGMAX_CODES[x.dtype], x.shape[1], ids.ctypes.data, n,
                                       temperature.ctypes.data, top_k.ctypes.data, top_p.ctypes.data,
                                       min_p.ctypes.data, uu.ctypes.data, out.ctypes.data)
    return out.tolist()


def sample_rows_excluding(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor,
                          exclude: list[int]) -> tuple[list[int], list[float]]:
    """Speculative decoding's rejection sampling on the kernel (``sampling_kernel(logits)`` must not be
    None): for each row r of ``logits`` [rows, vocab] (float32 or bfloat16) with ``params``' temperature,
    top-k, top-p and min-p, the probability of token ``exclude[r]`` (float64; -1 or an id outside the
    vocabulary: none, probability 0) as :func:`sampling_probs` gives it up to rounding, and the draw for
    ``u[r]`` (float64 [rows]) from the same probabilities with that token taken out, renormalised (the
    residual max(0, p - onehot) of a one-hot proposal). Returns (ids, probabilities): id -1 for a row
    holding a NaN or only -inf, or whose kept set was that token alone; probability NaN for the first
    kind."""
    x = logits.resolve_neg().contiguous()
    n = x.shape[0]
    ids = np.arange(n, dtype=np.int64)
    temperature, top_k, top_p, min_p = sampling_arrays([params] * n)
    uu = np.ascontiguousarray(u.numpy(), dtype=np.float64)
    ex = np.asarray(exclude, dtype=np.int64)
    out, pq = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.float64)
    sampling_kernel(x).kvs_sample_rows_excluding(
        x.data_ptr(), _ARGMAX_CODES[x.dtype], x.shape[1], ids.ctypes.data, n, temperature.ctypes.data,
        top_k.ctypes.data, top_p.ctypes.data, min_p.ctypes.data, uu.ctypes.data, ex.ctypes.data, out.ctypes.data,
        pq.ctypes.data)
    return out.tolist(), pq.tolist()


def sampling_arrays(params: list[SamplingParams | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``kvs_sample_rows``'s per-row settings: temperature (float32; 0 for None, a greedy row), top-k (int32,
    0: off), top-p (float32), min-p (float32)."""
    temperature = np.array([0.0 if p is None else p.temperature for p in params], dtype=np.float32)
    top_k = np.array([0 if p is None else min(max(p.top_k, 0), 2 ** 31 - 1) for p in params], dtype=np.int32)
    top_p = np.array([1.0 if p is None else p.top_p for p in params], dtype=np.float32)
    min_p = np.array([0.0 if p is None else p.min_p for p in params], dtype=np.float32)
    return temperature, top_k, top_p, min_p


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None],
                      u: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[num_rows, vocab]`` float32 (rows need not be normalised;
    zeros are never drawn) by inverting its CDF: the first token whose cumulative probability (float64)
    exceeds ``u·total``, ``u ~ U[0, 1)`` (float64 ``[num_rows]``; None: drawn by :func:`draw_uniforms`
    from ``generators``). Returns ``[num_rows]`` int64. (It replaced an exponential race, argmax of
    p / Exp(1) noise, which drew one exponential per vocabulary entry: ~1.5 ms per row for 49,152 tokens
    on this CPU.)
    """
    n = probs.shape[0]
    if u is None:
        u = draw_uniforms(generators)
    # two levels, both in float64: the block of CDF_BLOCK tokens whose cumulative mass first exceeds the
    # target, then the token inside it (a float64 cumsum of all 49,152 probabilities cost 4.4 ms for 16
    # rows here; the block sums 0.4)
    num_blocks = -(-probs.shape[1] // CDF_BLOCK)
    pad = num_blocks * CDF_BLOCK - probs.shape[1]  # zeros: never drawn
    padded = (F.pad(probs, (0, pad)) if pad else probs.contiguous()).view(n, num_blocks, CDF_BLOCK)
    block_cdf = padded.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [n, num_blocks]
    # u ≤ 1 − 2⁻⁵³, so u·total < total (the exact product total − total·2⁻⁵³ rounds down)
    target = u.to(probs.device).unsqueeze(1) * block_cdf[:, -1:]
    blk = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)  # [n, 1]; its mass > 0
    before = torch.where(blk > 0, block_cdf.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(target))
    inside = padded.gather(1, blk.unsqueeze(2).expand(n, 1, CDF_BLOCK)).squeeze(1)  # [n, CDF_BLOCK]
    pos = torch.searchsorted(before + inside.cumsum(dim=-1, dtype=torch.float64), target, right=True)
    # The block sum and the running sum inside it round differently, so the target can land just before
    # the block (pos 0) or past its end (pos CDF_BLOCK): take the block's first or last token of
    # probability > 0 then, never a zero (also for a row of zeros or NaN: an id inside the vocabulary).
    live = inside > 0
    idx = torch.arange(CDF_BLOCK, device=probs.device).expand(n, CDF_BLOCK)
    first_live = torch.where(live, idx, CDF_BLOCK).amin(dim=-1, keepdim=True)
    last_live = torch.where(live, idx, -1).amax(dim=-1, keepdim=True)
    pos = torch.maximum(torch.minimum(pos, last_live), first_live).clamp_(0, CDF_BLOCK - 1)
    return (blk * CDF_BLOCK + pos).squeeze(1).clamp_(max=probs.shape[1] - 1)


# ---------------------------------------------------------------------------------------- logprobs
def compute_logprobs(raw_logits: torch.Tensor, token_ids: list[int],
                     rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    """Logprobs of the RAW model logits (``log_softmax`` before min_tokens, penalties, temperature…).

    For each row with ``params.logprobs = k`` (may be 0): the sampled token's logprob; its ``rank`` =
    1 + the number of tokens with a STRICTLY greater logprob (tied tokens share the better rank, so
    the argmax has rank 1); and the top ``k`` tokens sorted by descending logprob (ties: lower id
    first among those selected). ``None`` for rows with ``params.logprobs is None``. On the CPU kernel
    path (``token_logprobs``) "greater" and the order are those of the logits, which the logprobs
    share except where two logits' logprobs round to one float32 value (then the greater logit counts
    and comes first, though both show the same logprob); among exactly tied logits the lowest ids are
    the ones selected.
    """
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    found = token_logprobs(raw_logits, [token_ids[i] for i in wanted], [rows[i].params.logprobs for i in wanted],
                           wanted)
    for i, lp in zip(wanted, found):
        result[i] = lp
    return result


KERNEL_MAX_TOP = 64  # layer_kernel.c's kvs_token_logprobs keeps at most this many alternatives a row


def token_logprobs(raw_logits: torch.Tensor, token_ids: list[int], ks: list[int],
                   rows: list[int] | None = None) -> list[TokenLogprobs]:
    """Row i: logprob and rank of ``token_ids[i]`` under ``log_softmax(raw_logits[rows[i]])`` and the top
    ``ks[i]`` alternatives (see :func:`compute_logprobs`); ``rows`` None: row i of ``raw_logits``.
    raw_logits: [n, vocab] float32 or bfloat16. On the CPU the kernel's ``kvs_token_logprobs`` (two passes
    over a row; its logprobs within float32 rounding of log_softmax's, its ranks and alternatives those of
    the logits' order), rows it leaves (a NaN or +inf, or only -inf) and other devices by PyTorch."""
    rows = list(range(len(token_ids))) if rows is None else rows
    k = max(ks, default=0)
    dll = sampling_kernel(raw_logits)
    num_rows, vocab = raw_logits.shape
    if (dll is None or k > min(KERNEL_MAX_TOP, vocab) or not token_ids
            or not (0 <= min(token_ids) and max(token_ids) < vocab and 0 <= min(rows) and max(rows) < num_rows)):
        return _torch_token_logprobs(raw_logits[rows], token_ids, ks)  # which raises on ids or k out of range
    x = raw_logits.resolve_neg().contiguous()
    n = len(token_ids)
    row_ids, ids = torch.tensor(rows, dtype=torch.int64), torch.tensor(token_ids, dtype=torch.int64)
    lp, rank, status = torch.empty(n), torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int32)
    top_ids, top_lp = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    dll.kvs_token_logprobs(x.data_ptr(), _ARGMAX_CODES[x.dtype], x.shape[1], row_ids.data_ptr(), n, ids.data_ptr(),
                           k, lp.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(),
                           status.data_ptr())
    lp_list, rank_list, ids_list, top_lp_list = lp.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist()
    out = [TokenLogprobs(token_id=t, logprob=lp_list[j], rank=rank_list[j], top_token_ids=ids_list[j][:kj],
                         top_logprobs=top_lp_list[j][:kj]) for j, (t, kj) in enumerate(zip(token_ids, ks))]
    left = [j for j, st in enumerate(status.tolist()) if st]
    if left:
        for j, found in zip(left, _torch_token_logprobs(raw_logits[[rows[j] for j in left]],
                                                        [token_ids[j] for j in left], [ks[j] for j in left])):
            out[j] = found
    return out


def _torch_token_logprobs(raw_logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """token_logprobs by PyTorch ops on every row of raw_logits [n, vocab]."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)  # [n, vocab]
    chosen = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)  # [n, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = _sorted_topk(logprobs, max(ks))
    chosen_list, rank_list = chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(token_id=t, logprob=chosen_list[j], rank=rank_list[j], top_token_ids=top_ids_list[j][:k],
                          top_logprobs=top_lp_list[j][:k]) for j, (t, k) in enumerate(zip(token_ids, ks))]


def _sorted_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk`` along the last dim, then ordered by (value descending, id ascending). ``[n, k]`` each."""
    if k == 0:
        empty = values[:, :0]
        return empty, empty.long()
    top_vals, top_ids = values.topk(k, dim=-1)
    by_id, order = top_ids.sort(dim=-1)
    vals_by_id = top_vals.gather(1, order)
    top_vals, order = vals_by_id.sort(dim=-1, descending=True, stable=True)
    return top_vals, by_id.gather(1, order)
