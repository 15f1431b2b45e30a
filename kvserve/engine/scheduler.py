"""One token-budget loop: continuous batching, chunked prefill, preemption by recompute.

There is no prefill phase: each request has ``num_tokens`` and ``num_computed_tokens``, and each step
gives some requests some of their missing tokens under ``max_num_batched_tokens``. Running requests
go first (decodes need one token each); waiting ones are admitted while budget, ``max_num_seqs`` and
free KV blocks allow. When a running request cannot get a block, the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later from its token ids, so no
token is lost or repeated. Touches no tensors.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.metrics.timeline import now
from kvserve.outputs import TokenLogprobs
from kvserve.request import Request, RequestStatus, SpecStats


@dataclass(slots=True)
class ScheduledRequest:
    """``num_scheduled_tokens`` tokens of ``request`` starting at ``num_computed_tokens``;
    ``sample`` is True when this chunk reaches the end of its known tokens (a new token follows).
    ``block_tables``: one per KV cache group (one group unless the model has sliding-window layers)."""

    request: Request
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_tables: list[list[int]]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify (last tokens of the chunk)
    # KV slots held beyond this step's tokens for more decode steps in the same engine step
    # (num_scheduler_steps > 1): the runner may run up to 1 + num_lookahead steps of this row
    num_lookahead: int = 0

    @property
    def is_decoding(self) -> bool:
        """The chunk starts past the prompt: one new token plus any proposals to verify (a chunk that
        starts inside the prompt is prefill, even a one-token one)."""
        return self.num_computed_tokens >= self.request.num_prompt_tokens

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (the only one without sliding-window layers)."""
        return self.block_tables[0]

    def token_ids(self) -> list[int]:
        """The chunk's input tokens: known tokens from num_computed_tokens, then any proposals."""
        start, n = self.num_computed_tokens, self.num_scheduled_tokens
        known = self.request.all_token_ids[start:start + n]
        return known + self.spec_token_ids[:n - len(known)]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes (1 token) first
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    """Sampled token (and logprobs) per request id that had ``sample=True``."""

    sampled: dict[str, tuple[int, TokenLogprobs | None]] = field(default_factory=dict)
    # multi-step decoding: the tokens of the steps after the first, in order (no logprobs), per request id;
    # every row of the engine step ran num_steps steps (tokens after a row's stop are dropped by update)
    more_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_steps: int = 1
    # speculative requests: verified tokens (accepted proposals + one corrected/bonus token)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request id -> (first position, logprobs of the prompt tokens that follow positions first, first+1, ...)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


def stop_token(req: Request, token_id: int, num_output_tokens: int) -> bool:
    """Whether ``token_id``, as the request's ``num_output_tokens``-th output token, ends it: an EOS id
    (unless ``ignore_eos``) or one of its ``stop_token_ids``, once ``min_tokens`` outputs exist. The
    scheduler's rule, which the model runner also asks to end a multi-step burst early."""
    p = req.sampling_params
    if num_output_tokens < p.min_tokens:
        return False
    return (not p.ignore_eos and token_id in req.eos_token_ids) or token_id in p.stop_token_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecStats()  # totals over all sequences
        # multi-step decoding: whether these decoding requests can run a burst together (the engine
        # sets it to the model runner's check); None: never
        self.can_burst: Callable[[list[Request]], bool] | None = None

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        self._add_lookahead(out)
        out.scheduled.sort(key=lambda s: s.num_scheduled_tokens != 1)  # decodes first (stable)
        t = now()
        for s in out.scheduled:
            if s.request.timeline.first_scheduled is None:
                s.request.timeline.first_scheduled = t
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
            if n <= 0:  # nothing to compute (cannot happen while running; kept as a guard)
                i += 1
                continue
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                             num_computed_tokens=req.num_computed_tokens):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._entry(req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: every later request already was too
        return budget

    def _add_lookahead(self, out: SchedulerOutput) -> None:
        """Multi-step decoding (``num_scheduler_steps`` K > 1): give every row of a step made only of
        decodes that can run back to back (``can_burst``: plain greedy or plain sampled rows on a model
        with the fused decode path) the KV slots of L more steps, the same L for all: at most K - 1, no
        step past a row's ``max_tokens`` or ``max_model_len`` (it would be dropped), and halved until
        the pool holds the new blocks of every row. Only when nothing waits (a burst would hold a
        waiting request back by its length) and nothing was preempted; once the step is scheduled, so
        the slots never cost another request its place."""
        steps = self.config.num_scheduler_steps
        if steps <= 1 or self.waiting or out.preempted_ids or not out.scheduled:
            return
        rows = out.scheduled
        if not all(s.num_scheduled_tokens == 1 and not s.spec_token_ids and s.sample and s.is_decoding
                   and s.request.num_output_tokens > 0 for s in rows):
            return
        if self.can_burst is None or not self.can_burst([s.request for s in rows]):
            return
        look = min(steps - 1, *(min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) - 1
                                for r in (s.request for s in rows)))
        while look > 0 and sum(self.kv.num_new_blocks_needed(s.request.request_id, s.request.num_tokens + look)
                               for s in rows) > self.kv.pool.num_free_blocks:
            look //= 2
        if look <= 0:
            return
        for s in rows:
            req = s.request
            if not self.kv.allocate_slots(req.request_id, req.num_tokens + look,
                                          num_computed_tokens=req.num_computed_tokens):
                raise RuntimeError(f"lookahead slots for {req.request_id} did not fit after the pool said they would")
            s.num_lookahead = look
            s.block_tables = self.kv.block_tables(req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._sibling_prefilling(req):  # n > 1: wait for the first choice's prompt blocks
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit = [], 0
            if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                hits, num_hit = self.kv.get_computed_blocks(req.request_id, req.all_token_ids, req.cache_keys)
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req.request_id, num_hit + n, hits):
                break  # FCFS: don't let later requests jump ahead of one waiting for blocks
            self.waiting.popleft()
            if self.kv.enable_prefix_caching and req.num_preemptions == 0:
                self.kv.record_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._entry(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _sibling_prefilling(self, req: Request) -> bool:
        """True when another choice of the same request is still computing the shared prompt, so
        this one can reuse its blocks once they are cached instead of computing copies."""
        if not self.kv.enable_prefix_caching or req.parent_id == req.request_id or req.num_computed_tokens:
            return False
        return any(r.parent_id == req.parent_id and r.num_computed_tokens < r.num_prompt_tokens for r in self.running)

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        missing = req.num_tokens - req.num_computed_tokens
        spec = req.spec_token_ids[:max(0, n - missing)]  # proposals that fit in the budget
        req.spec_token_ids = []
        return ScheduledRequest(req, req.num_computed_tokens, n, self.kv.block_tables(req.request_id),
                                sample=req.num_computed_tokens + n >= req.num_tokens, spec_token_ids=spec)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_ids.append(req.request_id)
        out.scheduled[:] = [s for s in out.scheduled if s.request is not req]

    # ------------------------------------------------------------------ update
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled (or verified) tokens, finish requests that hit EOS,
        a stop token id, ``max_tokens`` or ``max_model_len``. Returns (request, number of new tokens)
        for every request that got tokens."""
        updated = []
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_scheduled_tokens
            if req.request_id in result.prompt_logprobs:
                req.extend_prompt_logprobs(*result.prompt_logprobs[req.request_id])
            if not s.sample or req.is_finished:
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_keys)
                continue
            if req.request_id in result.spec_tokens:
                tokens = result.spec_tokens[req.request_id]
                self._record_spec(req, s, len(tokens) - 1)
                new = [(t, None) for t in tokens]
            else:
                new = [result.sampled[req.request_id]]
                more = result.more_tokens.get(req.request_id)
                if more:  # multi-step: each step computed one more token's KV (its input)
                    new += [(t, None) for t in more]
                    req.num_computed_tokens += len(more)
            n_new = self._append(req, new)
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_keys)
            updated.append((req, n_new))
        return updated

    def _append(self, req: Request, new: list[tuple[int, TokenLogprobs | None]]) -> int:
        """Append tokens until one stops the request. A request that stops caches its full blocks first
        (its KV is computed up to its last token: a burst or a verification may have computed past it),
        then returns its blocks."""
        for i, (token_id, logprobs) in enumerate(new):
            req.append_token(token_id, logprobs)
            status = self._check_stop(req, token_id)
            if status is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_keys)
                self.finish_request(req.request_id, status)
                return i + 1
        return len(new)

    def _record_spec(self, req: Request, s: ScheduledRequest, num_accepted: int) -> None:
        """Only the verified positions' KV is valid: rewind the computed count and release the slots
        of rejected proposals."""
        req.num_computed_tokens = s.num_computed_tokens + s.num_scheduled_tokens - len(s.spec_token_ids) + num_accepted
        self.kv.trim(req.request_id, req.num_computed_tokens + 1)
        req.spec_stats.record(len(s.spec_token_ids), num_accepted)
        self.spec_stats.record(len(s.spec_token_ids), num_accepted)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        if stop_token(req, token_id, req.num_output_tokens):
            p = req.sampling_params
            if p.ignore_eos or token_id not in req.eos_token_ids:  # a stop id, not an EOS: it is the reason
                req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request at any time; its blocks return to the pool immediately."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(request_id)
        return req
