"""Prefix caching: block reuse and LRU eviction in the pool, chained hashes, and output identical to
a non-caching engine (FAILURE-KINDS 10) including prompts ending on a block boundary, prompts sharing
1.5 blocks, n > 1, per-request salts and preemption."""
import random

from kvserve import SamplingParams
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager, hash_block
from tests.conftest import tiny_llm

G = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_pool_keeps_freed_full_blocks_until_evicted_lru():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.free_blocks([b, a, c])  # free order: b, a, c -> eviction order b, a, c
    assert pool.get_cached_block(b"A") is a and pool.num_free_blocks == 3
    pool.touch([a])  # reused: leaves the free list
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    (x,) = pool.get_new_blocks(1)  # takes b (least recently freed) and evicts its hash
    assert x is b and pool.get_cached_block(b"B") is None and pool.get_cached_block(b"A") is a


def test_chained_hashes():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h1 != hash_block(None, [1, 2, 3, 5])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != h1
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert len(kv.block_hashes("r", list(range(11)))) == 2  # only full blocks


def test_decode_steps_register_each_block_they_fill_once_and_again_after_preemption():
    """cache_full_blocks as the scheduler calls it, one token a step: every block a decode fills is
    registered under its chained hash (computed here from hash_block), and a step that fills none
    looks at no block (it only counts). After the request is freed (preemption) and re-admitted on
    new blocks, those are registered in turn."""
    bs, kv = 4, KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(100, 130))
    expect, h = [], None
    for i in range(len(tokens) // bs):
        h = hash_block(h, tokens[i * bs:(i + 1) * bs])
        expect.append(h)

    def decode(start: int, end: int) -> None:
        for n in range(start, end + 1):  # n tokens computed after this step
            assert kv.allocate_slots("r", n + 1, num_computed_tokens=n)
            kv.cache_full_blocks("r", tokens[:n + 1], n)
            blocks = kv._blocks["r"][0]
            assert [b.block_hash for b in blocks[:n // bs]] == expect[:n // bs]
            assert all(b.block_hash is None for b in blocks[n // bs:])

    decode(1, 17)
    looked = []

    class Spy(list):
        def __getitem__(self, i):
            looked.append(i)
            return list.__getitem__(self, i)
    kv._blocks["r"][0] = Spy(kv._blocks["r"][0])
    kv.cache_full_blocks("r", tokens[:19], 18)  # 18 tokens: still 4 full blocks, as after 17
    assert looked == []
    kv.cache_full_blocks("r", tokens[:21], 20)  # the fifth block is full now: only it is looked at
    assert set(looked) == {4} and kv._blocks["r"][0][4].block_hash == expect[4]
    kv.free("r")
    kv.pool.reset_prefix_cache()  # the hits are gone: re-admission takes new, unregistered blocks
    decode(1, 24)
    assert [b.block_hash for b in kv._blocks["r"][0][:6]] == expect[:6]


def test_a_block_refused_as_a_duplicate_takes_the_hash_once_the_holder_is_evicted():
    """Two requests with the same prompt admitted in the same step compute their own blocks; the first
    one's take the hashes and the second's are refused. Once the first request's blocks are evicted,
    the second's must take the hashes on a later step (found by the adversarial review: after
    cache_full_blocks stopped walking the whole table, a later request missed the still-cached prefix)."""
    kv = KVCacheManager(6, 4, enable_prefix_caching=True)
    prompt = list(range(100, 108))
    for r in "AB":
        assert kv.get_computed_blocks(r, prompt + [1])[1] == 0
        assert kv.allocate_slots(r, 9)
    for r in "AB":
        kv.cache_full_blocks(r, prompt + [1], 8)
    kv.free("A")
    assert kv.allocate_slots("C", 12)  # takes every free block: A's, with their hashes, are evicted
    kv.free("C")
    kv.cache_full_blocks("B", prompt + [1, 2], 9)  # a decode step of B that fills no block
    assert kv.get_computed_blocks("D", prompt + [9])[1] == 8
    # a trim below offered blocks forgets their offers and refusals (the second review's case: a refused
    # index past the trimmed table raised IndexError); the scheduler itself never trims that far
    kv = KVCacheManager(8, 1, enable_prefix_caching=True)
    for r in "ab":
        assert kv.allocate_slots(r, 3)
    for r in "ab":
        kv.cache_full_blocks(r, [5, 6, 7], 3)  # b's three blocks refused
    kv.trim("b", 1)
    kv.cache_full_blocks("b", [5, 6, 7], 1)
    assert kv._refused["b"] == [0] and kv._num_offered["b"] == 1


def test_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    ids = list(range(8))  # exactly two full blocks
    assert kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", ids, 8)
    kv.free("a")
    hits, n = kv.get_computed_blocks("b", ids)
    assert n == 4 and len(hits) == 1  # the second block is recomputed for its last token's logits


def _random_prompts(n, seed=0):
    rng = random.Random(seed)
    lens = [16, 32, 17, 31, 5, 48, 24, 40, 33, 15, 64, 9, 47, 20, 12, 50]  # 16/32/48/64: block boundaries
    return [[rng.randrange(100, 30000) for _ in range(lens[i % len(lens)])] for i in range(n)]


def test_caching_does_not_change_greedy_output():
    prompts = _random_prompts(16)
    shared = prompts[0][:10]
    prompts += [prompts[0][:16] + shared, prompts[0][:24] + [7, 8, 9]]  # share 1 and 1.5 blocks
    caching = tiny_llm(block_size=16)
    plain = tiny_llm(block_size=16, enable_prefix_caching=False)
    first = [o.outputs[0].token_ids for o in caching.generate(prompts, G)]
    kv = caching.engine.kv_manager
    hits_before = kv.num_hit_tokens
    second = [o.outputs[0].token_ids for o in caching.generate(prompts, G)]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, G)]
    assert first == second == ref
    assert kv.num_hit_tokens - hits_before >= 16 * 12  # the second pass really hit
    assert plain.engine.kv_manager.num_hit_tokens == 0
    assert kv.num_free_blocks == caching.engine.num_kv_blocks


def test_n_choices_share_prompt_blocks():
    llm = tiny_llm(block_size=16)
    prompt = _random_prompts(1, seed=3)[0] * 3  # 48 tokens = 3 full blocks
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    reqs_cached = llm.engine.kv_manager.num_hit_tokens
    assert reqs_cached >= 2 * 32  # choices 1 and 2 reuse the first two full blocks (the last is recomputed)
    plain = tiny_llm(block_size=16, enable_prefix_caching=False)
    again = plain.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_cache_salt_isolates_requests():
    llm = tiny_llm(block_size=16)
    eng = llm.engine
    prompt = _random_prompts(1, seed=9)[0] * 2
    for salt, expect_hit in (("alice", False), ("alice", True), ("bob", False), (None, False)):
        before = eng.kv_manager.num_hit_tokens
        eng.add_request(f"r-{salt}-{expect_hit}", prompt, G, cache_salt=salt)
        while eng.has_unfinished_requests():
            eng.step()
        assert (eng.kv_manager.num_hit_tokens > before) == expect_hit, salt


def test_eviction_then_miss_and_preemption_with_caching():
    prompts = _random_prompts(8, seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny_llm(max_model_len=128, enable_prefix_caching=False).generate(prompts, params)]
    tight = tiny_llm(max_model_len=128, num_kv_blocks=10, block_size=16)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == ref and tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv_manager.num_free_blocks == 10
