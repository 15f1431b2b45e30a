"""Decode-only steps of a Llama model as one flat loop of kernel calls: the CPU stand-in for replaying
a captured CUDA graph.

Per layer: RMSNorm, QKV matmul, RoPE + KV write, decode attention, O matmul, residual add + RMSNorm,
gate/up matmul, SiLU·up, down matmul: nine calls, into buffers allocated once per step. When every
matrix is int4 in kvserve's tile layout (no bias) and the step has fewer rows than the layers'
``dense_min_tokens``, or every matrix is int8 (:class:`kvserve.models.quant.Int8Linear`) and the step
has fewer rows than both theirs and ``GEMV_MAX_ROWS`` + 1, or every matrix is a dense float32
:class:`kvserve.models.linear.Linear` of a float32 model and the step has at most ``GEMV_MAX_ROWS``
rows, the whole loop is one C call
(``kvs_llama_decode`` in ``layer_kernel.c``): the same kernels in one parallel region, with barriers
where the loop returns to Python (SmolLM2 int4 batch 1: ~7 → ~4 ms). The kernels
are the ones :class:`kvserve.models.llama.LlamaForCausalLM`'s modules call (the matmuls through the
modules' own ``forward``), in the same order, so the hidden states are bit-identical to the module
path (tested); only Python's per-op work is gone. Between two matmuls that stream weights from memory,
every eager op's interpreter and dispatcher state is cold again, so a decode step's glue cost several
times what it costs in a tight loop; this removes most of it.

A plain greedy step (:meth:`LlamaDecodePlan.greedy`) also runs the LM head and the argmax in that one
call when the head is int4 tiles, int8 rows or (float32 model) a dense float32 matrix: the same kernels on
the same input as ``compute_logits`` and the greedy sampler, so the same token ids (tested), without the
return to Python, the head's own fork and join and the logits tensor in between. A step that samples
(:meth:`LlamaDecodePlan.logits`) runs the head there too and returns its logits, the values
``compute_logits(plan(...), float32=False)`` gives (tested), for the sampler; where every row is greedy
or samples with no logprobs or logits processors, :meth:`LlamaDecodePlan.sample` draws the tokens in the
call too (the sampler's kernel), and only the ids come back.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.attention import AttentionMetadata, kv_quant_kernel
from kvserve.models.fused_ops import ACT_CODES, MAX_ROPE_HEAD_DIM, cache_args
from kvserve.models.linear import GEMV_MAX_ROWS, Linear, gemv_kernel
from kvserve.models.quant import KERNEL_DTYPE, Int4Linear, Int8Linear, PackedLinear


class LlamaDecodePlan:
    """Built once per (model, KV caches); call with a decode-only step. A weight or norm parameter
    given new storage after that (``p.data = new``) makes the next call rebuild the plan.

    ``plan(input_ids [B] int64, positions [B] int64, meta)`` → final-norm hidden states [B, hidden].
    KV caches: float32/bfloat16 tensors or QuantizedKVCache pairs (int8/fp8 codes + scales, written and
    read by the same kernels as the module path)."""

    def __init__(self, model, kv_caches: list[tuple], dll):
        cfg = model.config
        self.dll = dll
        self.model = model
        self.H, self.Hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden, self.inter, self.eps = cfg.hidden_size, cfg.intermediate_size, model.norm.eps
        self.scale = model.layers[0].self_attn.scale
        self.embed = model.embed_tokens.weight
        self._embed_contiguous = self.embed.is_contiguous()
        self.cos, self.sin = model.rotary_emb.cos, model.rotary_emb.sin
        self.final_norm = model.norm.weight
        self.caches = kv_caches  # kept alive: the plan holds their data pointers
        act = self.embed.dtype
        self.layers = []
        ptrs = [cache_args(kc, vc) for kc, vc in kv_caches]  # (K, V, K scales, V scales, code) per layer
        for layer, (kc, vc, ks, vs, _) in zip(model.layers, ptrs):
            a, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append((n1.weight.data_ptr(), ACT_CODES[n1.weight.dtype], a.qkv_proj.forward,
                                _input_dtype(a.qkv_proj, act), kc, vc, ks, vs, a.o_proj.forward,
                                _input_dtype(a.o_proj, act), n2.weight.data_ptr(), ACT_CODES[n2.weight.dtype],
                                mlp.gate_up_proj.forward, _input_dtype(mlp.gate_up_proj, act), mlp.down_proj.forward,
                                _input_dtype(mlp.down_proj, act)))
        self.cache_code = ptrs[0][4]
        self.block_size = kv_caches[0][0].shape[1]
        # all four matrices of every layer int4 tiles, int8 rows, or dense float32 matrices of a float32
        # model, without bias: the whole step is one C call
        self.one_call_layers, self.one_call_kind, self.one_call_rows = None, -1, 0
        # tensors whose data pointers the plan holds as integers: kept alive here, and compared on each
        # call, so a parameter given new storage (``p.data = new``) rebuilds the plan instead of reading
        # freed memory
        self._pinned = [self.embed] + [n.weight for layer in model.layers for n in (layer.input_layernorm,
                                                                                      layer.post_attention_layernorm)]
        norm_codes = {ACT_CODES[n.weight.dtype] for n in [model.norm] + [n for layer in model.layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]}
        linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                   for layer in model.layers]
        mats = [m for ms in linears for m in ms]
        if len(norm_codes) == 1 and all(m.bias is None for m in mats):
            if all(isinstance(m, Int4Linear) and m.layout == "tiles" for m in mats):
                self.one_call_kind = 0
                self.one_call_rows = min(m.dense_min_tokens for m in mats)  # more rows: the dense copy (none on AMX)
                weights = [[m.packed.data_ptr() for m in ms] for ms in linears]
            elif (act == torch.float32 and gemv_kernel() is not None
                  and all(isinstance(m, Linear) and m.weight.dtype == torch.float32 and m.weight.is_contiguous()
                          for m in mats)):
                self.one_call_kind = 1
                self.one_call_rows = GEMV_MAX_ROWS + 1  # more rows: the modules run PyTorch's matmul
                weights = [[m.weight.data_ptr() for m in ms] for ms in linears]
            elif gemv_kernel() is not None and all(isinstance(m, Int8Linear) for m in mats):
                self.one_call_kind = 2
                # more rows: torch's int8 kernel or the dense copy
                self.one_call_rows = min(GEMV_MAX_ROWS + 1, *(m.dense_min_tokens for m in mats))
                weights = [[m.qweight.data_ptr() for m in ms] for ms in linears]
                scales = [[m.scales.data_ptr() for m in ms] for ms in linears]
            if self.one_call_kind >= 0:
                if self.one_call_kind != 2:
                    scales = [[0] * 4 for _ in linears]
                for m in mats:
                    self._pinned += ([m.packed] if self.one_call_kind == 0 else [m.weight] if self.one_call_kind == 1
                                     else [m.qweight, m.scales])
                self.norm_code = norm_codes.pop()
                self.one_call_layers = torch.tensor(
                    [w + [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                          kc, vc, ks or 0, vs or 0] + sc
                     for w, sc, layer, (kc, vc, ks, vs, _) in zip(weights, scales, model.layers, ptrs)],
                    dtype=torch.int64)

        # greedy(): the LM head in the same C call, where the module path would run one of the step's
        # kernels on it, as its forward does: an int4-tiles or int8 head (bfloat16 input: the last norm's
        # output, rounded to bfloat16 in a float32 model as the module casts it), or a dense float32 head
        # of a float32 model (the tied embedding too); no bias. Its kind need not be the layers' (a
        # GGUF's Q4_1 layers with its Q8_0 head: int4 and int8).
        self.lm_head, self.lm_head_rows = None, 0  # (matrix, int8 row scales or None); rows below which it runs
        self._lm_args = (None, -1, None, 0)  # its C arguments: matrix pointer, kind, scales pointer, vocab rows
        lm, rows, kind = model.lm_head, 0, -1
        if self.one_call_kind >= 0 and (lm is None or lm.bias is None):
            if isinstance(lm, Int4Linear) and lm.layout == "tiles" and act in (torch.bfloat16, torch.float32):
                self.lm_head, rows, kind = (lm.packed, None), lm.dense_min_tokens, 0
            elif (isinstance(lm, Int8Linear) and act in (torch.bfloat16, torch.float32)
                  and gemv_kernel() is not None):
                rows = min(lm.dense_min_tokens, GEMV_MAX_ROWS + 1)  # above: torch's int8 kernel or the dense copy
                self.lm_head, kind = (lm.qweight, lm.scales), 2
            elif act == torch.float32 and gemv_kernel() is not None and (lm is None or type(lm) is Linear):
                w = self.embed if lm is None else lm.weight
                if w.dtype == torch.float32 and w.is_contiguous():
                    self.lm_head, rows, kind = (w, None), GEMV_MAX_ROWS + 1, 1
        if self.lm_head is not None:
            self.lm_head_rows = min(self.one_call_rows, rows)
            self._pinned += [t for t in self.lm_head if t is not None]
            w, sc = self.lm_head
            vocab = self.embed.shape[0] if lm is None else lm.out_features
            self._lm_args = (w.data_ptr(), kind, None if sc is None else sc.data_ptr(), vocab)
        self._pinned_ptrs = [t.data_ptr() for t in self._pinned]
        self._object_addrs = torch.tensor(_object_addresses(self._pinned), dtype=torch.int64)
        self._token_ids = torch.empty(1, dtype=torch.int64)  # greedy(): the C call's output, [max B seen]
        self._token_ids_np = self._token_ids.numpy()
        self._logits: torch.Tensor | None = None  # logits(): the C call's output, [max B seen, vocab]

    @staticmethod
    def build(model, kv_caches) -> "LlamaDecodePlan | None":
        """The plan, or None when a part of the model or cache has no kernel here (the module path runs)."""
        dll = kv_quant_kernel.load()
        if dll is None or model.config.head_dim > MAX_ROPE_HEAD_DIM or model.embed_tokens.weight.dtype not in ACT_CODES:
            return None
        codes = {None if (c := cache_args(kc, vc)) is None else c[4] for kc, vc in kv_caches}
        if None in codes or len(codes) != 1:
            return None
        norms = [model.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.weight.dtype not in ACT_CODES or not n.weight.is_contiguous() for n in norms):
            return None
        return LlamaDecodePlan(model, kv_caches, dll)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self._follow_storage()
        out = self._step(input_ids, positions, meta)
        self._warm_objects()
        return out

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               follow_storage: bool = True) -> list[int] | None:
        """The step and each row's greedy next token (``kvs_argmax_rows`` of its logits: the first maximum,
        or the first NaN), with the LM head in the same C call as the layers: the ids the module path's
        ``compute_logits`` and the greedy sampler give, without returning to Python in between (SmolLM2
        int4: ~0.5 ms of Python and a thread wake-up per step at 4096 tokens). None, with nothing run,
        where the head has no kernel there (see ``lm_head``) or the step has too many rows for it.

        ``follow_storage=False`` skips the check that the weights still live where the plan was built
        (~100 µs on a decode step: ~200 data pointers read from cold caches) and the prefetch behind it:
        only for a step that follows a call of this plan with no other code in between (the steps of
        one multi-step burst), where nothing can have given a parameter new storage."""
        if follow_storage:
            self._follow_storage()
        B = input_ids.shape[0]
        if not self.head_in_call(B):
            return None
        self._reserve_token_ids(B)
        self._step(input_ids, positions, meta, self._token_ids)  # the C call writes the first B
        if follow_storage:
            self._warm_objects()
        return self._token_ids_np[:B].tolist()

    def sample(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               draw: Callable[[], tuple[np.ndarray, ...]],
               follow_storage: bool = True) -> tuple[list[int], torch.Tensor] | None:
        """The step and each row's next token with the LM head and the sampling in the same C call, for a
        step whose rows are greedy or sample from the raw logits. ``draw()`` is called once the step is
        sure to run and returns per row temperature (float32 [B], 0: greedy), top-k (int32 [B], 0: off),
        top-p (float32 [B]), min-p (float32 [B]) and u (float64 [B]) (``sampler.sampling_arrays`` and
        ``draw_uniforms``): a greedy row gets the id :meth:`greedy` gives, a sampled row the draw of the
        sampler's ``kvs_sample_rows`` for that u (-1 for logits with a NaN or only -inf, which the caller
        decides from the logits). Returns (ids, logits [B, vocab] as :meth:`logits` returns them); None,
        with nothing run and ``draw`` not called, where :meth:`greedy` would return None.
        ``follow_storage``: as :meth:`greedy`.

        Raises:
            ValueError: ``draw()`` did not give five arrays of B values."""
        if follow_storage:
            self._follow_storage()
        B = input_ids.shape[0]
        if not self.head_in_call(B):
            return None
        arrays = tuple(draw())
        if len(arrays) != 5 or any(np.shape(a) != (B,) for a in arrays):
            raise ValueError(f"draw() must give 5 arrays of shape ({B},), got {[np.shape(a) for a in arrays]}")
        sampling = tuple(np.ascontiguousarray(a, dtype=t) for a, t in
                         zip(arrays, (np.float32, np.int32, np.float32, np.float32, np.float64)))
        self._reserve_token_ids(B)
        logits = self._logits_buffer(B)
        self._step(input_ids, positions, meta, self._token_ids, logits, sampling)
        if follow_storage:
            self._warm_objects()
        return self._token_ids_np[:B].tolist(), logits

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step and its logits [B, vocab] (bfloat16; float32 for a dense float32 head), with the LM head
        in the same C call as the layers: ``compute_logits(plan(...), float32=False)``'s values, for a
        step that samples (SmolLM2 int4: the head as a module call cost ~0.75 ms a step at 128 tokens
        against ~0.45 ms inside the call). The tensor is a view of a buffer the next call overwrites: use
        it before then. None, with nothing run, where :meth:`greedy` would return None."""
        self._follow_storage()
        B = input_ids.shape[0]
        if not self.head_in_call(B):
            return None
        out = self._logits_buffer(B)
        self._step(input_ids, positions, meta, logits=out)
        self._warm_objects()
        return out

    def _reserve_token_ids(self, B: int) -> None:
        if self._token_ids.shape[0] < B:  # kept between steps: a fresh tensor costs ~35 µs on a cold step
            self._token_ids = torch.empty(B, dtype=torch.int64)
            self._token_ids_np = self._token_ids.numpy()

    def _logits_buffer(self, B: int) -> torch.Tensor:
        """[B, vocab] in the head's output dtype: the first B rows of a buffer kept between steps."""
        if self._logits is None or self._logits.shape[0] < B:
            dtype = torch.float32 if self._lm_args[1] == 1 else torch.bfloat16
            self._logits = torch.empty(B, self._lm_args[3], dtype=dtype)
        return self._logits[:B]

    def head_in_call(self, B: int) -> bool:
        """A step of B rows runs as the one C call with the LM head in it (:meth:`greedy`, :meth:`sample`)."""
        return self.lm_head is not None and self.one_call_layers is not None and B < self.lm_head_rows

    def _follow_storage(self) -> None:
        if [t.data_ptr() for t in self._pinned] != self._pinned_ptrs:  # new weight storage: new pointers
            self.__init__(self.model, self.caches, self.dll)

    def _warm_objects(self) -> None:
        """Prefetch the objects the next step's ``_follow_storage`` reads (``kvs_prefetch_lines``), which the
        step just run has pushed out of the caches; they arrive while the engine does its bookkeeping."""
        addrs = self._object_addrs
        self.dll.kvs_prefetch_lines(addrs.data_ptr(), addrs.shape[0], OBJECT_BYTES)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              token_ids: torch.Tensor | None = None, logits: torch.Tensor | None = None,
              sampling: tuple[np.ndarray, ...] | None = None) -> torch.Tensor | None:
        """token_ids: [≥ B] int64 for the next tokens (greedy, or drawn with ``sampling``'s temperature, top-k,
        top-p, min-p and u per row), and/or logits: [B, vocab] contiguous for the LM head's output (either: the LM head
        in the one C call, which must apply); else None (the hidden states)."""
        dll, H, Hkv, d, n, inter, eps = self.dll, self.H, self.Hkv, self.d, self.hidden, self.inter, self.eps
        B = input_ids.shape[0]
        act, cc, nt = ACT_CODES[self.embed.dtype], self.cache_code, torch.get_num_threads()
        if self.one_call_layers is not None and B < self.one_call_rows:  # the loop below, in one C call
            # the C call gathers the embedding rows itself (checking the ids) where it can read the table and
            # the ids as int64 (F.embedding also takes int32 ids)
            gather = self._embed_contiguous and input_ids.dtype == torch.int64 and input_ids.is_contiguous()
            x = None if gather else F.embedding(input_ids, self.embed)
            head = token_ids is not None or logits is not None
            out = None if head else torch.empty(B, n, dtype=self.embed.dtype)  # with the head: ids or logits only
            tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
            rc = dll.kvs_llama_decode(self.one_call_layers.data_ptr(), len(self.layers), self.one_call_kind,
                                      self.norm_code, None if x is None else x.data_ptr(), self.embed.data_ptr(),
                                      self.embed.shape[0], input_ids.data_ptr(), positions.data_ptr(),
                                      self.cos.data_ptr(), self.sin.data_ptr(), meta.slot_mapping.data_ptr(),
                                      tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                                      self.final_norm.data_ptr(), None if out is None else out.data_ptr(), B, n, H,
                                      Hkv, d, inter, eps, self.scale, self.block_size, act, cc, nt,
                                      *((None, -1, None, 0, None, None) if not head
                                        else (*self._lm_args, None if token_ids is None else token_ids.data_ptr(),
                                              None if logits is None else logits.data_ptr())),
                                      *((None,) * 5 if sampling is None else (a.ctypes.data for a in sampling)))
            if rc:
                raise IndexError(f"input_ids: a token id outside [0, {self.embed.shape[0]}) (the embedding's rows)")
            return out
        x = F.embedding(input_ids, self.embed)  # [B, hidden]: the residual stream, updated in place
        # matmul inputs in the dtype each layer multiplies in (bf16 for packed layers of a float32 model:
        # the kernels write the float32 result cast to bf16, as the layer would cast it)
        bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

        def buf(name: str, dt: torch.dtype, width: int) -> tuple[int, int]:
            if (name, dt) not in bufs:
                bufs[name, dt] = torch.empty(B, width, dtype=dt)
            return bufs[name, dt].data_ptr(), ACT_CODES[dt]

        q = torch.empty(B, H, d, dtype=x.dtype)
        xp, qp = x.data_ptr(), q.data_ptr()
        pos, slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        bt, bts, sl = tables.data_ptr(), tables.stride(0), seq_lens.data_ptr()
        cos, sin = self.cos.data_ptr(), self.sin.data_ptr()
        norm, rope, attend, silu = dll.kvs_add_rms_norm, dll.kvs_rope_write_kv, dll.kvs_decode_attention, dll.kvs_silu_mul
        delta = None  # the previous layer's MLP output, added to the stream by the next norm
        for (nw, nwc, qkv_proj, qkv_in, kc, vc, ks, vs, o_proj, o_in, pw, pwc, gate_up_proj, gu_in, down_proj,
             down_in) in self.layers:
            hp, hc = buf("h", qkv_in, n)
            norm(xp, None if delta is None else delta.data_ptr(), act if delta is None else ACT_CODES[delta.dtype],
                 nw, nwc, eps, hp, hc, B, n, act, nt)
            qkv = qkv_proj(bufs["h", qkv_in])  # [B, (H + 2 Hkv) d]
            rope(qkv.data_ptr(), ACT_CODES[qkv.dtype], qkv.stride(0), pos, cos, sin, qp, None, kc, vc, ks, vs, slots,
                 B, H, Hkv, d, act, cc, nt)
            op, oc = buf("o", o_in, H * d)
            attend(qp, kc, vc, ks, vs, bt, bts, sl, op, oc, B, H, Hkv, d, self.block_size, self.scale, cc, act, nt)
            a = o_proj(bufs["o", o_in])  # [B, hidden]
            hp, hc = buf("h", gu_in, n)
            norm(xp, a.data_ptr(), ACT_CODES[a.dtype], pw, pwc, eps, hp, hc, B, n, act, nt)
            gu = gate_up_proj(bufs["h", gu_in])  # [B, 2 I]
            gp, gc = buf("g", down_in, inter)
            silu(gu.data_ptr(), ACT_CODES[gu.dtype], gp, gc, B, inter, act, nt)
            delta = down_proj(bufs["g", down_in])  # [B, hidden]
        out = torch.empty_like(x)
        norm(xp, delta.data_ptr(), ACT_CODES[delta.dtype], self.final_norm.data_ptr(), ACT_CODES[self.final_norm.dtype],
             eps, out.data_ptr(), act, B, n, act, nt)
        return out


OBJECT_BYTES = 256  # prefetched from each address of _object_addresses: a TensorImpl's fields data_ptr() reads


def _object_addresses(tensors: list[torch.Tensor]) -> list[int]:
    """Where ``t.data_ptr()`` looks for each tensor: its Python object (CPython's ``id``), its TensorImpl
    (``_cdata``) and its StorageImpl (the storage's ``_cdata``); only the first where a torch build has
    no ``_cdata``. Addresses for prefetching only: nothing is read through them."""
    out = []
    for t in tensors:
        out.append(id(t))
        try:
            out += [t._cdata, t.untyped_storage()._cdata]
        except (AttributeError, RuntimeError):
            pass
    return out


def _input_dtype(linear: torch.nn.Module, act: torch.dtype) -> torch.dtype:
    """The dtype a linear layer multiplies in: packed int4/int8 layers cast their input to bfloat16 first."""
    return KERNEL_DTYPE if isinstance(linear, PackedLinear) else act
