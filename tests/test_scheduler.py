"""Scheduler and KV cache manager, without a model: token budget, chunked prefill, decode-first
ordering, max_num_seqs, preemption by recompute, abort, and the pool returning to fully free."""
import pytest

from kvserve.config import SchedulerConfig
from kvserve.engine.scheduler import RunnerOutput, Scheduler
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.metrics.timeline import RequestTimeline
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams


def _req(rid, n_prompt, max_tokens=4, **kw):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), max_tokens,
                   (2,), RequestTimeline())


def _sched(num_blocks=100, block_size=4, budget=16, max_seqs=8, max_len=1000):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, max_len), kv


def _fake_run(sched_out, token=7):
    return RunnerOutput({s.request.request_id: (token, None) for s in sched_out.scheduled if s.sample})


def test_block_pool_lru_and_refcounts():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and pool.num_free_blocks == 2
    pool.free_blocks([a[1], a[0]])  # freed tail-first
    b = pool.get_new_blocks(4)
    assert [x.block_id for x in b] == [2, 3, 1, 0]  # least recently freed first
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    with pytest.raises(AssertionError):
        pool.free_blocks([b[0], b[0]])


def test_manager_all_or_nothing():
    kv = KVCacheManager(3, 4)
    assert kv.allocate_slots("a", 9)  # 3 blocks
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots("b", 1)
    assert kv.block_table("b") == []
    kv.free("a")
    assert kv.num_free_blocks == 3


def test_chunked_prefill_under_budget_then_decode():
    s, kv = _sched(budget=8)
    r = _req("a", 20)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out = s.schedule()
        chunks.append(out.scheduled[0].num_scheduled_tokens)
        assert out.scheduled[0].sample == (r.num_computed_tokens + chunks[-1] == 20)
        s.update(out, _fake_run(out))
    assert chunks == [8, 8, 4]
    out = s.schedule()
    assert out.scheduled[0].num_scheduled_tokens == 1  # decode of the sampled token


def test_decodes_first_and_budget_shared():
    s, _ = _sched(budget=10)
    a = _req("a", 3)
    s.add_request(a)
    s.update(s.schedule(), RunnerOutput({"a": (7, None)}))
    s.add_request(_req("b", 30))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [x.num_scheduled_tokens for x in out.scheduled] == [1, 9]


def test_max_num_seqs():
    s, _ = _sched(max_seqs=2)
    for i in range(4):
        s.add_request(_req(str(i), 2))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_finish_on_length_eos_and_stop_token():
    s, kv = _sched()
    a, b, c = _req("a", 2, max_tokens=2), _req("b", 2), _req("c", 2, stop_token_ids=[9])
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    s.update(out, RunnerOutput({"a": (5, None), "b": (2, None), "c": (9, None)}))
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason is None
    assert c.status == RequestStatus.FINISHED_STOPPED and c.stop_reason == 9
    out = s.schedule()
    s.update(out, RunnerOutput({"a": (2, None)}))  # EOS on the last allowed token -> stop, not length
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == 100


def test_min_tokens_blocks_eos_and_ignore_eos():
    s, _ = _sched()
    a, b = _req("a", 2, max_tokens=5, min_tokens=2), _req("b", 2, max_tokens=3, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update(out, RunnerOutput({"a": (2, None), "b": (2, None)}))
    assert not a.is_finished and not b.is_finished
    out = s.schedule()
    s.update(out, RunnerOutput({"a": (2, None), "b": (2, None)}))
    assert a.status == RequestStatus.FINISHED_STOPPED
    out = s.schedule()
    s.update(out, RunnerOutput({"b": (2, None)}))
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 3


def test_preemption_by_recompute_keeps_tokens_and_frees_pool():
    s, kv = _sched(num_blocks=6, block_size=4, budget=64)
    reqs = [_req(str(i), 6, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert not out.is_empty
        for x in out.scheduled:  # every scheduled chunk continues exactly where the cache ends
            assert x.num_computed_tokens == x.request.num_computed_tokens
            assert len(x.block_table) * 4 >= x.num_computed_tokens + x.num_scheduled_tokens
        s.update(out, RunnerOutput({x.request.request_id: (100 + x.request.num_output_tokens, None)
                                    for x in out.scheduled if x.sample}))
        steps += 1
        assert steps < 200
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == list(range(100, 108))  # nothing lost or repeated
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == 6


def test_abort_returns_blocks_immediately():
    s, kv = _sched()
    r = _req("a", 10)
    s.add_request(r)
    s.update(s.schedule(), RunnerOutput({"a": (5, None)}))
    assert kv.num_free_blocks < 100
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 100 and not s.has_unfinished()
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
