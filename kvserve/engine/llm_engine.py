"""``add_request`` / ``step`` / ``abort_request``: schedule → run → update, nothing else.

Policy lives in the scheduler, tensors in the model runner, text in the detokenizer. The engine
wires them, fans an ``n > 1`` request out into ``n`` sequences and gathers their outputs back.
"""
from __future__ import annotations

import logging
import os
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from kvserve import memory
from kvserve.config import ConfigError, EngineConfig, ModelConfig, parse_kv_cache_dtype
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.spec import KVCacheSpec
from kvserve.metrics.step_stats import StepStats, routed_expert_bytes_read, weight_bytes_of
from kvserve.metrics.timeline import RequestTimeline, now
from kvserve.models.catalog import ModelSource, resolve_model
from kvserve.models.loader import load_checkpoint
from kvserve.models.registry import build_model
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import InvalidRequestError, SamplingParams
from kvserve.spec_decode.speculator import build_speculator, load_draft

logger = logging.getLogger(__name__)


class PromptTooLongError(InvalidRequestError):
    """Prompt (+ max_tokens) does not fit in the context length."""


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    num_sent_tokens: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


def _one_thread_after_fork() -> None:
    """A forked child inherits libgomp's record of the parent's thread pool but not its threads: its first
    parallel region with more than one thread waits for them forever (kvserve's kernels and PyTorch's own
    share libgomp). The child computes on one thread instead, as PyTorch's DataLoader workers do."""
    torch.set_num_threads(1)


_FORK_HANDLER = False


def _register_fork_handler() -> None:
    global _FORK_HANDLER
    if not _FORK_HANDLER and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_one_thread_after_fork)
        _FORK_HANDLER = True


class LLMEngine:
    """The engine. Single-threaded: callers serialise ``add_request``/``step``/``abort_request``.
    A process forked after an engine exists runs its torch and kernel work on one thread (a forked
    child's OpenMP pool would otherwise hang it)."""

    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config.validate()
        _register_fork_handler()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.dummy_config is not None:  # an explicit shape with random weights
            source = ModelSource("dummy", None, config.dummy_config.name, config.dummy_config)
        else:
            source = resolve_model(config.model, config.load_format)
        ckpt = load_checkpoint(source, seed=config.seed, progress=progress, tokenizer=config.tokenizer)
        self.model_config: ModelConfig = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_name = source.name
        self.dtype = config.torch_dtype
        self._check_weights_fit(ckpt.config)
        # a draft model that cannot work (another vocabulary, too big alone) fails before the target's load
        draft_ckpt = load_draft(config.spec_decode, ckpt.config.vocab_size, self.dtype, config.seed)
        self.model = build_model(ckpt.config, self.dtype, ckpt.weights, seed=config.seed)
        self.weight_kinds = self._quantize_weights(ckpt)
        memory.model_to_huge_pages(self.model)  # after packing: the tensors a decode step streams
        if config.compile:
            from kvserve.engine.compile import compile_decoder_layers
            compile_decoder_layers(self.model)
        self.max_model_len = self._resolve_max_model_len()
        kv_dtype = parse_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec.from_model(ckpt.config, kv_dtype, config.cache.block_size)
        self._weights_resident = memory.resident_bytes(self.model)  # as held: packed matrices packed
        num_blocks = self._resolve_num_blocks()
        self.kv_spec.check_fits(num_blocks, self.max_model_len, config.scheduler.max_num_batched_tokens,
                                self._pool_setting()[0])
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, self._prefix_caching(),
                                         group_windows=[g.sliding_window for g in self.kv_spec.groups])
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_spec, num_blocks)
        self.scheduler.can_burst = self.runner.can_burst
        if config.scheduler.num_scheduler_steps > 1 and not self.runner.may_burst():
            logger.warning("num_scheduler_steps=%d has no effect for %s here: only a model whose decode steps run "
                           "as the decode plan's one C call with the LM head (int4/int8 matrices, or float32 "
                           "ones in a float32 model; no sliding-window layers, no --compile) runs bursts; every "
                           "step is single", config.scheduler.num_scheduler_steps, config.model)
        # a draft model must fit beside the target's weights as held (packed ones packed) and its KV cache
        resident = self._weights_resident + num_blocks * self.kv_spec.bytes_per_block
        self.speculator = build_speculator(config.spec_decode, ckpt.config.vocab_size, self.dtype, config.seed,
                                           resident_bytes=resident, draft_ckpt=draft_ckpt)
        self.weight_bytes_per_step, self._embedding_row_bytes = weight_bytes_of(self.model)
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)
        self._parents: dict[str, _Parent] = {}
        self._pending: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self._step = 0
        # seconds spent making speculative proposals (a draft model's steps, n-gram lookups), outside
        # every step's wall_s, which times the target model's step only
        self.propose_s = 0.0

    # ------------------------------------------------------------------ setup helpers
    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        want = self.config.scheduler.max_model_len or limit
        if want > limit:
            from kvserve.config import ConfigError
            raise ConfigError(f"max_model_len ({want}) exceeds the model's context length ({limit})")
        return want

    def _quantize_weights(self, ckpt) -> dict[str, int]:
        """Pack matrices as int4/int8 per ``weight_dtype`` (kvserve/models/quant.py); count per kind."""
        wd = self.config.weight_dtype
        if wd in ("float32", "bfloat16") or (wd == "auto" and ckpt.quant_sources is None):
            return {"float": -1}
        from kvserve.models.quant import quantize_model
        return quantize_model(self.model, wd, ckpt.quant_sources() if ckpt.quant_sources else None)

    def _prefix_caching(self) -> bool:
        """Whether prefix caching is on: as configured, except for models with sliding-window layers."""
        if self.config.cache.enable_prefix_caching and any(g.sliding_window for g in self.kv_spec.groups):
            logger.warning("prefix caching is off for %s: its sliding-window layers free the blocks that leave "
                           "their window, so a cached prefix would lack them", self.model_name)
            return False
        return self.config.cache.enable_prefix_caching

    def _check_weights_fit(self, cfg: ModelConfig) -> None:
        """ConfigError (instead of the OOM killer) when the weights alone (parameters × the dtype's size,
        as built before any packing) exceed the memory this process may use (physical, or a lower cgroup
        limit: :func:`kvserve.memory.memory_limit_bytes`)."""
        need = memory.nbytes(cfg.num_params(), self.dtype)
        have, what = memory.memory_limit()
        if need > have:
            raise ConfigError(f"model {cfg.name}: {cfg.num_params() / 1e9:.1f}B parameters in "
                              f"{str(self.dtype).removeprefix('torch.')} need {need / 2**30:.1f} GiB, more than "
                              f"{what} ({have / 2**30:.1f} GiB); try --dtype bfloat16 or a smaller model")

    def _pool_setting(self) -> tuple[str, str]:
        """The setting that sized the KV pool, and its flag, for the messages that say what to lower."""
        if self.config.cache.num_blocks is not None:
            return "num_kv_blocks", "--num-kv-blocks"
        return "kv_cache_memory", "--kv-cache-memory"

    def _resolve_num_blocks(self) -> int:
        c = self.config.cache
        if c.num_blocks is not None:
            num_blocks = c.num_blocks
        else:
            num_blocks = max(1, self.kv_spec.num_blocks_for(c.kv_cache_memory_bytes or c.DEFAULT_MEMORY_BYTES))
        need = num_blocks * self.kv_spec.bytes_per_block
        have, what = memory.memory_limit()  # the cache lives in host memory, beside the weights
        if need + self._weights_resident > have:
            name, flag = self._pool_setting()
            raise ConfigError(f"{name}: {num_blocks} blocks x {self.kv_spec.bytes_per_block} B = "
                              f"{memory.format_size(need)} beside the weights' "
                              f"{memory.format_size(self._weights_resident)} exceeds {what} "
                              f"({memory.format_size(have)}); lower {flag}")
        return num_blocks

    @property
    def num_steps(self) -> int:
        """Steps run so far (``StepStats.step`` of the latest step)."""
        return self._step

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, timeline: RequestTimeline | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises InvalidRequestError (param named) for an
        empty prompt, token ids outside the vocabulary, or prompt + max_tokens > max_model_len.
        ``cache_salt`` keeps this request's prefix-cache entries apart from other salts'."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                                      "sampling_params")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        taken = [r for r in (request_id, *child_ids) if r in self._parents or r in self.scheduler.requests]
        if taken:  # an n > 1 request's sequences are "<id>-<i>": those ids must be free too
            raise InvalidRequestError(f"request_id {taken[0]!r} is already in use", "request_id")
        self.validate_prompt(prompt_token_ids, params)
        timeline = timeline or RequestTimeline()
        if timeline.tokenized is None:
            timeline.tokenized = now()
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_token_ids)
        children, detoks = [], []
        for i, rid in enumerate(child_ids):
            tl = timeline if i == 0 else RequestTimeline(arrival=timeline.arrival, tokenized=timeline.tokenized)
            seed = params.seed + i if params.seed is not None else self._rng.randrange(2**62)
            req = Request(rid, prompt_token_ids, params, max_tokens, self.model_config.eos_token_ids, tl,
                          prompt=prompt, parent_id=request_id, index=i,
                          generator=torch.Generator().manual_seed(seed), cache_salt=cache_salt)
            children.append(req)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params))
        parent = _Parent(request_id, prompt, list(prompt_token_ids), children, detoks, [0] * params.n)
        self._parents[request_id] = parent
        if max_tokens == 0:  # nothing to generate: finish without touching the model
            for req in children:
                req.status = RequestStatus.FINISHED_LENGTH
                req.timeline.finished = now()
            self._pending.append(self._make_output(parent))
            del self._parents[request_id]
            return
        for req in children:
            self.scheduler.add_request(req)

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """InvalidRequestError unless the prompt is non-empty, in the vocabulary and fits with max_tokens,
        and every logit_bias id is in the vocabulary.
        Reads only immutable limits, so any thread may call it."""
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", "prompt")
        out_of_vocab = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if out_of_vocab:
            raise InvalidRequestError(f"logit_bias token id {out_of_vocab[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", "logit_bias")
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise PromptTooLongError(f"prompt has {n} tokens but the context length (max_model_len) is "
                                     f"{limit}: at most {limit - 1} prompt tokens leave room for one "
                                     f"output token", "prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise PromptTooLongError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                                     f"{n + params.max_tokens} exceeds the context length "
                                     f"(max_model_len) of {limit} tokens", "max_tokens")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its ``n`` sequences) at any time; blocks return to the pool now."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        t = now()
        for req in parent.children:
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
                req.timeline.finished = t
            if self.speculator is not None:
                self.speculator.free(req.request_id)
        return self._make_output(parent)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._parents)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One schedule → execute → update round. Returns an output for every request that got new
        tokens or finished in this step."""
        outputs, self._pending = self._pending, []
        if self.speculator is not None:
            t = now()
            self.speculator.propose(self.scheduler.running, self.max_model_len)
            self.propose_s += now() - t
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        t0 = now()
        result = self.runner.execute(sched)
        wall = now() - t0
        self._record_step(sched, t0, wall, result.num_steps)
        updated = self.scheduler.update(sched, result)
        touched: dict[str, _Parent] = {}
        for req, num_new in updated:
            parent = self._parents[req.parent_id]
            self._detokenize(parent, req, num_new)
            touched[parent.request_id] = parent
            if req.is_finished and self.speculator is not None:
                self.speculator.free(req.request_id)
        for parent in touched.values():
            outputs.append(self._make_output(parent))
            if parent.finished:
                del self._parents[parent.request_id]
        return outputs

    def _detokenize(self, parent: _Parent, req: Request, num_new: int) -> None:
        """Text for the ``num_new`` tokens just appended (several after a speculative step); an EOS or
        stop token id that ended the sequence adds no text."""
        detok = parent.detoks[req.index]
        stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
        new_ids = req.output_token_ids[len(req.output_token_ids) - num_new:]
        if stopped_by_token:
            new_ids = new_ids[:-1]
        t = now()
        stop = detok.update(new_ids, req.num_output_tokens)
        t_done = now()
        req.timeline.detokenize_s += t_done - t
        if stop is not None:
            # tokens after the stop string's token: accepted proposals, or a multi-step burst's later
            # tokens, up to and including an EOS or stop id that ended the row after the string
            extra = len(new_ids) - detok.num_used + stopped_by_token
            if extra:
                del req.output_token_ids[-extra:], req.all_token_ids[-extra:]
                if req.logprobs is not None and len(req.logprobs) > len(req.output_token_ids):
                    del req.logprobs[len(req.output_token_ids):]
                num_new -= extra
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.status = RequestStatus.FINISHED_STOPPED  # a stop string wins over length on the same token
            req.stop_reason = stop
        req.timeline.token_times.extend([t_done] * num_new)  # tokens of one step leave together
        if req.is_finished:
            req.timeline.finished = now()

    def _record_step(self, sched, t0: float, wall: float, num_steps: int = 1) -> None:
        """One StepStats for the engine step; a multi-step burst of ``num_steps`` decode steps (one token
        per row each) counts the tokens, weight bytes and KV bytes of all of them, over its whole wall."""
        num_tokens = sched.num_tokens * num_steps
        seq_lens = [s.num_computed_tokens + s.num_scheduled_tokens for s in sched.scheduled]
        self._step += 1
        self.step_stats.append(StepStats(
            step=self._step, start_s=t0, wall_s=wall, num_seqs=len(sched.scheduled), num_tokens=num_tokens,
            # a decoding sequence's one new token, plus the proposals verified with it (speculation)
            num_decode_tokens=num_steps * sum(s.num_scheduled_tokens for s in sched.scheduled
                                              if s.is_decoding and s.num_scheduled_tokens == 1 + len(s.spec_token_ids)),
            weight_bytes=(num_steps * self.weight_bytes_per_step + num_tokens * self._embedding_row_bytes
                          + routed_expert_bytes_read(self.model)),  # MoE: only the experts this step used
            kv_bytes_read=sum(self.kv_spec.kv_bytes_read(n + j, s.num_scheduled_tokens)  # sliding: window only
                              for n, s in zip(seq_lens, sched.scheduled) for j in range(num_steps)),
            kv_bytes_per_token=self.kv_spec.bytes_per_token,
            request_ids=tuple(s.request.request_id for s in sched.scheduled), num_steps=num_steps))

    @staticmethod
    def _latency(req: Request):
        lat = req.timeline.breakdown(req.num_prompt_tokens, req.num_preemptions)
        st = req.spec_stats
        lat.num_drafts, lat.num_draft_tokens, lat.num_accepted_tokens = (st.num_drafts, st.num_draft_tokens,
                                                                        st.num_accepted_tokens)
        return lat

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for i, (req, detok) in enumerate(zip(parent.children, parent.detoks)):
            finished = req.is_finished
            sent = parent.num_sent_tokens[i]
            parent.num_sent_tokens[i] = req.num_output_tokens
            outs.append(CompletionOutput(
                index=req.index, text=detok.output_text, token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason.value if finished else None, stop_reason=req.stop_reason,
                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                delta_text=detok.take_delta(finished), delta_token_ids=req.output_token_ids[sent:],
                latency=self._latency(req) if finished else None))
        first = parent.children[0]
        prompt_lps = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished=parent.finished, prompt_logprobs=prompt_lps)
