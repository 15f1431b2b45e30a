"""Turns a SchedulerOutput into batch tensors, runs the model, samples.

Owns the KV cache tensors: per layer a pair ``[num_blocks, block_size, num_kv_heads, head_dim]``
(for int8/fp8 a pair of ``QuantizedKVCache``: 1-byte codes of that shape plus scales); for MLA one
latent cache per layer ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` (no V).
With sliding-window layers the layers form KV cache groups (kvserve/kv_cache/spec.py): the i-th layer
of every group uses the i-th pair of tensors (with its group's block ids), and each group gets its own
AttentionMetadata; the model then receives one metadata per layer.
Builds ``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``seq_lens`` and
``query_start_loc`` (on CPU, a step of one-token rows writes them into the tensors of the step before:
``_prepare_one_token``); computes logits only for sequences that sample this step. A decode step whose
rows all want the plain greedy token runs the model's ``greedy_decode`` where it has one (Llama: the
LM head and argmax inside the decode plan's one C call) instead of forward + LM head + sampler; any
step whose rows are greedy or sample with no logprobs or logits processors runs ``decode_sample``
(the sampling in that call too); any other decode-only step runs ``decode_logits`` where it has one (the LM
head in that call), then the sampler. Decides nothing about who runs.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve import memory
from kvserve.attention import AttentionMetadata
from kvserve.attention.kv_quant import QuantizedKVCache, kind_of_dtype
from kvserve.engine.sampler import (Sampler, SamplingRow, draw_uniforms, plain_greedy, plain_sampled, sample_from_probs,
                                    sampling_arrays, sampling_probs, token_logprobs)
from kvserve.engine.scheduler import RunnerOutput, SchedulerOutput, stop_token
from kvserve.spec_decode.verify import verify
from kvserve.kv_cache.spec import KVCacheSpec


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_spec: KVCacheSpec, num_blocks: int,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.kv_spec = kv_spec
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.groups = kv_spec.groups
        # every cache tensor in one arena of 2 MiB pages (kvserve/memory.py), not one mapping each
        num_caches = (kv_spec.num_layers if kv_spec.attention == "mla"
                      else 2 * (kv_spec.layers_per_block if len(self.groups) > 1 else kv_spec.num_layers))
        caches = iter(self._alloc_caches(num_caches))
        if kv_spec.attention == "mla":
            self.kv_caches = [next(caches) for _ in range(kv_spec.num_layers)]
        elif len(self.groups) > 1:  # tensor slot i holds the i-th layer of every group
            slots = [(next(caches), next(caches)) for _ in range(kv_spec.layers_per_block)]
            slot_of = {layer: i for g in self.groups for i, layer in enumerate(g.layer_ids)}
            self.kv_caches = [slots[slot_of[layer]] for layer in range(kv_spec.num_layers)]
        else:
            self.kv_caches = [(next(caches), next(caches)) for _ in range(kv_spec.num_layers)]
        self.sampler = Sampler()
        # steps whose every row has one query token reuse one set of input tensors (_prepare_one_token):
        # CPU, one KV cache group, no sliding window
        self.reuse_decode_inputs = (self.device.type == "cpu" and len(self.groups) == 1
                                    and not self.groups[0].sliding_window)
        self._one_token_inputs: _OneTokenInputs | None = None

    def _alloc_caches(self, n: int) -> list:
        """n layer caches (K, V or MLA latent): float tensors, or QuantizedKVCache (1-byte codes + scales)."""
        spec = self.kv_spec
        shape = (self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        kind = kind_of_dtype(spec.dtype)
        if kind is None:
            return memory.zeros_many([(shape, spec.dtype)] * n, self.device)
        flat = memory.zeros_many(QuantizedKVCache.tensor_specs(shape) * n, self.device)
        return [QuantizedKVCache(flat[2 * i], flat[2 * i + 1], kind) for i in range(n)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput()
        input_ids, positions, meta, layer_meta = self._prepare(sched)
        out = RunnerOutput()
        if self._fused_greedy(sched, input_ids, positions, layer_meta, out) \
                or self._fused_sample(sched, input_ids, positions, layer_meta, out):
            self._more_steps(sched, input_ids, positions, layer_meta, out)
            return out
        logits = self._fused_logits(sched, input_ids, positions, layer_meta)
        if logits is not None:  # a decode step that samples, its LM head in the decode plan's C call
            self._sample(sched, list(range(len(sched.scheduled))), logits, out)
            return out
        hidden = self.model(input_ids, positions, self.kv_caches, layer_meta)  # [T, hidden]
        self._prompt_logprobs(sched, hidden, meta, out)
        self._verify(sched, hidden, meta, out)
        sample_idx = [i for i, s in enumerate(sched.scheduled) if s.sample and not s.spec_token_ids]
        if not sample_idx:
            return out
        if len(sample_idx) == hidden.shape[0]:  # a decode step: every row is a sequence's last token
            logits = self.model.compute_logits(hidden, float32=False)  # [N, vocab]; the sampler casts if needed
        else:
            last_token = meta.query_start_loc[1:] - 1  # [num_seqs] index of each sequence's last token
            logits = self.model.compute_logits(hidden[last_token[sample_idx]], float32=False)  # [N, vocab]
        self._sample(sched, sample_idx, logits, out)
        return out

    def may_burst(self) -> bool:
        """The model and cache layout can run multi-step bursts at all (see :meth:`can_burst`): a decode
        plan whose one C call holds the layers and the LM head for one row (builds the plan if it is not
        built yet)."""
        if getattr(self.model, "decode_plan", None) is None or not getattr(self.model, "use_decode_plan", False) \
                or len(self.groups) != 1 or any(g.sliding_window for g in self.groups):
            return False
        plan = self.model.decode_plan(self.kv_caches)
        return plan is not None and plan.head_in_call(1)

    def can_burst(self, requests: list) -> bool:
        """Whether a decode-only step of these requests (one new token each) would take the fused path
        that multi-step bursts run on: every row plain greedy or plain sampled, a model whose decode plan
        runs the layers and the LM head in one C call here (no sliding-window layers), and a batch small
        enough for it. The scheduler asks before it holds KV slots for a burst."""
        if not requests or not self.may_burst() or not self.model.decode_plan(self.kv_caches).head_in_call(len(requests)):
            return False
        rows = [self._row(r) for r in requests]
        return all(plain_greedy(r) or plain_sampled(r) for r in rows)

    def _more_steps(self, sched: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                    out: RunnerOutput) -> None:
        """Multi-step decoding (``num_scheduler_steps``): after a fused first step, up to
        ``min(num_lookahead)`` more steps of every row, each fed the tokens the step before chose, into
        ``out.more_tokens``; stops early once every row has stopped (an EOS or stop token id past its
        ``min_tokens``; ``max_tokens`` and ``max_model_len`` already bound the lookahead). The inputs
        are advanced in place (``advance_decode_inputs``); the steps skip the decode plan's storage check,
        as no other code runs between them. A step the fused path cannot take (it would not, as nothing
        about the rows changes) ends the burst."""
        rows = sched.scheduled
        num_steps = 1 + min(s.num_lookahead for s in rows)
        if num_steps == 1:
            return
        reqs = [s.request for s in rows]
        tokens = [out.sampled[r.request_id][0] for r in reqs]
        more: list[list[int]] = [[] for _ in rows]
        stopped = [stop_token(r, t, r.num_output_tokens + 1) for r, t in zip(reqs, tokens)]
        for j in range(1, num_steps):
            if all(stopped):
                break
            advance_decode_inputs(input_ids, positions, meta, tokens)
            step = RunnerOutput()
            if not (self._fused_greedy(sched, input_ids, positions, meta, step, follow_storage=False)
                    or self._fused_sample(sched, input_ids, positions, meta, step, follow_storage=False)):
                break
            tokens = [step.sampled[r.request_id][0] for r in reqs]
            for i, (r, t) in enumerate(zip(reqs, tokens)):
                more[i].append(t)
                stopped[i] = stopped[i] or stop_token(r, t, r.num_output_tokens + j + 1)
            out.num_steps += 1
        for r, m in zip(reqs, more):
            if m:
                out.more_tokens[r.request_id] = m

    def _sample(self, sched: SchedulerOutput, sample_idx: list[int], logits: torch.Tensor, out: RunnerOutput) -> None:
        """Sample the scheduled rows ``sample_idx`` from ``logits`` [len(sample_idx), vocab] into ``out``."""
        rows = [self._row(sched.scheduled[i].request) for i in sample_idx]
        result = self.sampler(logits, rows)
        for i, tok, lp in zip(sample_idx, result.token_ids, result.logprobs):
            out.sampled[sched.scheduled[i].request.request_id] = (tok, lp)

    def _decode_only(self, sched: SchedulerOutput) -> bool:
        """Every row decodes one token that it samples (no prefill chunk, no speculative proposals)."""
        return all(s.sample and s.num_scheduled_tokens == 1 and not s.spec_token_ids and s.is_decoding
                   for s in sched.scheduled)

    def _fused_sample(self, sched: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, layer_meta,
                      out: RunnerOutput, follow_storage: bool = True) -> bool:
        """A decode step whose every row is plain greedy or plain sampled (``plain_sampled``: temperature,
        top-k, top-p, min-p; no logprobs or processors) on a model that can take it with the LM head and
        the sampling in its decode step's one C call (``decode_sample``): run it so and fill ``out``. Each
        sampled row's u is drawn as the sampler draws it (``draw_uniforms``), only once the step is sure to
        run; a row the kernel leaves to the PyTorch path (logits with a NaN or only -inf) gets that path's
        draw for the same u.
        False, with nothing run and nothing drawn, otherwise."""
        decode_sample = getattr(self.model, "decode_sample", None)
        if decode_sample is None or not self._decode_only(sched):
            return False
        rows = [self._row(s.request) for s in sched.scheduled]
        if not all(plain_greedy(r) or plain_sampled(r) for r in rows):
            return False
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        u = np.zeros(len(rows), dtype=np.float64)

        def draw() -> tuple[np.ndarray, ...]:
            if sampled:
                u[sampled] = draw_uniforms([rows[i].generator for i in sampled]).numpy()
            return (*sampling_arrays([None if r.params.greedy else r.params for r in rows]), u)
        result = decode_sample(input_ids, positions, self.kv_caches, layer_meta, draw, follow_storage)
        if result is None:
            return False
        token_ids, logits = result
        left = [i for i, t in enumerate(token_ids) if t < 0]
        if left:  # the PyTorch path's draw for those rows, with the same u
            probs = sampling_probs(logits[left].float(), [rows[i].params for i in left])
            for i, t in zip(left, sample_from_probs(probs, [None] * len(left), torch.from_numpy(u[left])).tolist()):
                token_ids[i] = t
        for s, tok in zip(sched.scheduled, token_ids):
            out.sampled[s.request.request_id] = (tok, None)
        return True

    def _fused_logits(self, sched: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor,
                      layer_meta) -> torch.Tensor | None:
        """A decode-only step on a model that can run its LM head in the decode step's one C call
        (``decode_logits``): run it so and return the logits [B, vocab] (``compute_logits(...,
        float32=False)``'s values); None, with nothing run, otherwise."""
        decode_logits = getattr(self.model, "decode_logits", None)
        if decode_logits is None or not self._decode_only(sched):
            return None
        return decode_logits(input_ids, positions, self.kv_caches, layer_meta)

    def _fused_greedy(self, sched: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, layer_meta,
                      out: RunnerOutput, follow_storage: bool = True) -> bool:
        """A decode step whose every row wants the plain greedy token (the argmax of the raw logits: no
        logprobs, penalties, bias or min_tokens left) on a model that can take it with the LM head in its
        decode step's one C call (``greedy_decode``): run it so and fill ``out``. False, with nothing run,
        otherwise."""
        greedy_decode = getattr(self.model, "greedy_decode", None)
        if greedy_decode is None or not self._decode_only(sched):
            return False
        if not all(plain_greedy(self._row(s.request)) for s in sched.scheduled):
            return False
        token_ids = greedy_decode(input_ids, positions, self.kv_caches, layer_meta, follow_storage)
        if token_ids is None:
            return False
        for s, tok in zip(sched.scheduled, token_ids):
            out.sampled[s.request.request_id] = (tok, None)
        return True

    def _prepare(self, sched: SchedulerOutput):
        if self.reuse_decode_inputs and all(s.num_scheduled_tokens == 1 for s in sched.scheduled):
            return self._prepare_one_token(sched)
        ids: list[int] = []
        pos: list[int] = []
        for s in sched.scheduled:
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            ids.extend(s.token_ids())
            pos.extend(range(start, start + n))
        ctx, qlens = [s.num_computed_tokens for s in sched.scheduled], [s.num_scheduled_tokens for s in sched.scheduled]
        metas = [AttentionMetadata.build([s.block_tables[i] for s in sched.scheduled], ctx, qlens,
                                         self.kv_spec.block_size, self.device, sliding_window=g.sliding_window)
                 for i, g in enumerate(self.groups)]
        decoding = all(s.is_decoding for s in sched.scheduled)
        for m in metas:
            m.all_decoding = decoding
        ids_pos = torch.tensor([ids, pos], dtype=torch.int64, device=self.device)  # one copy: [2, T]
        return ids_pos[0], ids_pos[1], metas[0], metas[0] if len(metas) == 1 else self.per_layer_metadata(metas)

    def _prepare_one_token(self, sched: SchedulerOutput):
        """``_prepare`` for a step whose every row has one query token (decodes, or a prompt's last token):
        the same values (``AttentionMetadata.flat_values``), all rewritten each step by one numpy copy into
        the tensors of the last such step with as many rows and block-table columns (vLLM keeps a
        persistent batch in the same spirit). Why: on a decode step, whose weight stream has just evicted
        the caches, the general path's two ``torch.tensor`` calls and six views took 125-260 µs and this
        takes 39-90 µs, about a third (SmolLM2 int4, batch 1, 128-4096 tokens, timed around ``_prepare``,
        three runs). The tensors are
        overwritten by the next such step: nothing may keep them past ``execute``."""
        rows = sched.scheduled
        bs = self.kv_spec.block_size
        tables = [s.block_tables[0] for s in rows]
        B, M = len(rows), max(len(t) for t in tables)
        buf = self._one_token_inputs
        if buf is None or buf.shape != (B, M):
            buf = self._one_token_inputs = _OneTokenInputs(B, M)
        pos = [s.num_computed_tokens for s in rows]
        values, seq_lens = AttentionMetadata.flat_values(tables, pos, [1] * B, bs)
        buf.array[:] = [i for s in rows for i in s.token_ids()] + pos + values
        meta = AttentionMetadata(slot_mapping=buf.slot_mapping, block_tables=buf.block_tables, seq_lens=buf.seq_lens,
                                 query_start_loc=buf.query_start_loc, seq_lens_list=seq_lens,
                                 query_lens_list=[1] * B, num_decodes=B, block_size=bs)
        meta.decode_mask = meta._build_decode_mask()
        meta.all_decoding = all(s.is_decoding for s in rows)
        return buf.input_ids, buf.positions, meta, meta

    def per_layer_metadata(self, metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
        """Each layer's group metadata, in layer order."""
        group_of = {layer: i for i, g in enumerate(self.groups) for layer in g.layer_ids}
        return [metas[group_of[layer]] for layer in range(self.kv_spec.num_layers)]

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor, meta, out: RunnerOutput) -> None:
        """For requests asking for prompt logprobs: logits at every position of this chunk whose next
        token is a prompt token, scored against that token."""
        for i, s in enumerate(sched.scheduled):
            req = s.request
            k = req.sampling_params.prompt_logprobs
            if k is None or s.num_computed_tokens + 1 >= req.num_prompt_tokens:
                continue
            start = s.num_computed_tokens
            end = min(start + s.num_scheduled_tokens, req.num_prompt_tokens - 1)  # positions with a next prompt token
            first = int(meta.query_start_loc[i])
            logits = self.model.compute_logits(hidden[first:first + end - start])  # [end - start, vocab]
            targets = req.prompt_token_ids[start + 1:end + 1]
            out.prompt_logprobs[req.request_id] = (start, token_logprobs(logits, targets, [k] * len(targets)))

    def _verify(self, sched: SchedulerOutput, hidden: torch.Tensor, meta, out: RunnerOutput) -> None:
        """Speculative sequences: target logits at their last k + 1 positions decide the tokens."""
        for i, s in enumerate(sched.scheduled):
            if not s.sample or not s.spec_token_ids:
                continue
            end = int(meta.query_start_loc[i + 1])
            k = len(s.spec_token_ids)
            logits = self.model.compute_logits(hidden[end - k - 1:end])  # [k + 1, vocab]
            req = s.request
            out.spec_tokens[req.request_id] = verify(logits, s.spec_token_ids, req.sampling_params, req.generator)

    @staticmethod
    def _row(req) -> SamplingRow:
        return SamplingRow(params=req.sampling_params, generator=req.generator,
                           prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
                           eos_token_ids=req.eos_token_ids)


def advance_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                          token_ids: list[int]) -> None:
    """Turn a decode step's inputs (B rows of one token each) into the next step's, in place: each row's
    input the token it just got (``token_ids``), its position + 1 and ``seq_lens`` + 1, its new slot
    ``block_tables[row, pos // block_size] * block_size + pos % block_size`` (the block must be in its
    table already: the scheduler's lookahead slots), and the mask for the longer sequences.
    ``input_ids``, ``positions``, ``meta.slot_mapping``, ``meta.seq_lens``: [B] int64; ``block_tables``:
    [B, max_blocks] int64, all CPU tensors (numpy views write them without a torch call each)."""
    bs = meta.block_size
    pos = positions.numpy()
    pos += 1
    meta.seq_lens.numpy()[:] += 1
    input_ids.numpy()[:] = token_ids
    tables = meta.block_tables.numpy()
    meta.slot_mapping.numpy()[:] = tables[np.arange(len(pos)), pos // bs] * bs + pos % bs
    meta.seq_lens_list = [n + 1 for n in meta.seq_lens_list]
    if meta.decode_mask is not None:
        meta.decode_mask = meta._build_decode_mask()


class _OneTokenInputs:
    """The int64 input tensors of a step of B one-token rows with M block-table columns, views of one
    buffer (input_ids | positions | slot_mapping | block_tables | seq_lens | query_start_loc) whose numpy
    view ``array`` takes each step's values."""

    def __init__(self, B: int, M: int):
        self.shape = (B, M)
        flat = torch.zeros(5 * B + B * M + 1, dtype=torch.int64)
        self.array = flat.numpy()
        self.input_ids, self.positions, self.slot_mapping = flat[:B], flat[B:2 * B], flat[2 * B:3 * B]
        self.block_tables = flat[3 * B:3 * B + B * M].view(B, M)
        self.seq_lens, self.query_start_loc = flat[3 * B + B * M:4 * B + B * M], flat[4 * B + B * M:]
