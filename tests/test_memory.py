"""kvserve/memory.py: weights and KV cache in 2 MiB pages, same values, same tokens."""
import gc
import io
import mmap
import os

import pytest
import torch

from kvserve import memory
from tests.conftest import tiny_llm
from kvserve import SamplingParams

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_available() -> bool:
    try:
        return "[never]" not in open(THP).read()
    except OSError:
        return False


def _smaps_kb(t: torch.Tensor, field: str) -> int:
    """``field`` (kB, e.g. "AnonHugePages", "Rss") of the mapping holding t's first byte, from /proc/self/smaps."""
    addr, inside = t.data_ptr(), False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _anon_huge_kb(t: torch.Tensor) -> int:
    return _smaps_kb(t, "AnonHugePages")


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="no MADV_HUGEPAGE on this platform")
def test_huge_page_zeros_aligned_zero_and_writable():
    t = memory.huge_page_zeros(5 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 5 << 20
    assert t.data_ptr() % memory.HUGE_PAGE_BYTES == 0
    assert int(t.count_nonzero()) == 0
    t[-1] = 7
    gc.collect()  # the tensor alone keeps the mapping alive
    assert int(t[-1]) == 7 and int(t.sum()) == 7


@pytest.mark.skipif(not (memory.huge_pages_enabled() and _thp_available()), reason="transparent huge pages off")
def test_huge_page_zeros_gets_huge_pages():
    """The kernel really backs the touched arena with 2 MiB pages (a shared mapping would not get them)."""
    t = memory.huge_page_zeros(8 << 20)
    t.fill_(1)
    assert _anon_huge_kb(t) >= 2048


def test_huge_page_zeros_off_and_bad_size(monkeypatch):
    with pytest.raises(ValueError, match="num_bytes"):
        memory.huge_page_zeros(-1)
    assert memory.huge_page_zeros(0).numel() == 0
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    assert not memory.huge_pages_enabled()
    t = memory.huge_page_zeros(3 << 20)
    assert t.numel() == 3 << 20 and int(t.count_nonzero()) == 0


def test_zeros_shape_dtype():
    t = memory.zeros((3, 16, 2, 8), torch.bfloat16)
    assert t.shape == (3, 16, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.equal(t, torch.zeros(3, 16, 2, 8, dtype=torch.bfloat16))


def test_move_to_huge_pages_copies_values_aligned():
    src = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(33).to(torch.bfloat16),
           torch.randint(0, 255, (1000,), dtype=torch.uint8)]
    out = memory.move_to_huge_pages(src)
    for a, b in zip(src, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % memory.ALIGN_BYTES == 0 and b.data_ptr() != a.data_ptr()
    out[0].zero_()  # copies, not views of the sources, and not of each other
    assert src[0].abs().sum() > 0 and torch.equal(out[1], src[1])


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.randn(64, 16))
        self.register_buffer("top", self.table[:32])  # a view of another buffer: left where it is
        self.register_buffer("prepacked", torch.randn(4, 4).to_mkldnn())  # opaque: no storage to move

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)) + self.table[: ids.numel()].sum())


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="no MADV_HUGEPAGE on this platform")
def test_model_to_huge_pages_keeps_ties_views_and_outputs():
    torch.manual_seed(0)
    m = _Tied()
    ids = torch.tensor([1, 4, 9])
    want = m(ids)
    weight = m.embed.weight
    moved = memory.model_to_huge_pages(m)
    expect = sum(t.numel() * t.element_size() for t in (m.embed.weight, m.proj.weight, m.proj.bias))
    assert moved == expect  # the tied weight once; the buffer with a view of it not at all
    assert m.embed.weight is weight and m.head.weight.data_ptr() == m.embed.weight.data_ptr()
    assert m.embed.weight.data_ptr() % memory.HUGE_PAGE_BYTES == 0  # the arena's first tensor
    assert 0 < m.proj.weight.data_ptr() - m.embed.weight.data_ptr() < memory.HUGE_PAGE_BYTES  # next in it
    assert m.top.data_ptr() == m.table.data_ptr()  # still a view of table
    assert m.prepacked.layout == torch._mkldnn
    assert torch.equal(m(ids), want)
    buf = io.BytesIO()  # one storage per tensor: torch.save takes the mixed dtypes, and only their bytes
    torch.save({k: v for k, v in m.state_dict().items() if v.layout == torch.strided}, buf)
    assert buf.tell() < 20_000
    m2 = _Tied()
    m2.load_state_dict(torch.load(io.BytesIO(buf.getvalue())), strict=False)
    assert torch.equal(m2.embed.weight, m.embed.weight)


def test_model_to_huge_pages_leaves_quantized_and_nested_buffers():
    m = torch.nn.Linear(4, 4)
    m.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    m.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    m.register_buffer("n", torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]))
    memory.model_to_huge_pages(m)
    assert m.q.is_quantized and m.n.is_nested


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="no MADV_HUGEPAGE on this platform")
def test_zeros_many_share_one_mapping():
    """Many small cache tensors in one arena: not one 2 MiB-rounded mapping each."""
    ts = memory.zeros_many([((16,), torch.float32)] * 100 + [((3, 5), torch.bfloat16)])
    assert all(int(t.count_nonzero()) == 0 for t in ts) and ts[-1].shape == (3, 5)
    assert ts[-1].data_ptr() - ts[0].data_ptr() == 100 * memory.ALIGN_BYTES
    assert _smaps_kb(ts[0], "Rss") <= 2048 + 4  # written at startup: one page, not 100
    with pytest.raises(ValueError, match="does not fit"):
        memory.Arena(64).empty((17,), torch.float32)


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), (" False ", False), ("no", False),
                                      ("1", True), ("", True)])
def test_switch_values(value, on, monkeypatch):
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", value)
    assert memory.huge_pages_enabled() == (on and hasattr(mmap, "MADV_HUGEPAGE"))


def test_impossible_size_fails_cleanly():
    with pytest.raises((RuntimeError, ValueError)):
        memory.huge_page_zeros(1 << 63)


def test_engine_kv_cache_and_weights_in_huge_pages_same_tokens(monkeypatch):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 33, 2, 71, 8], [100, 3, 3, 41]]
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    plain = [o.outputs[0].token_ids for o in tiny_llm(kv_cache_memory="8MiB").generate(prompts, sp)]
    monkeypatch.delenv("KVSERVE_HUGE_PAGES")
    llm = tiny_llm(kv_cache_memory="8MiB")
    if memory.huge_pages_enabled():
        k, v = llm.engine.runner.kv_caches[0]
        assert k.data_ptr() % memory.HUGE_PAGE_BYTES == 0  # the first cache tensor opens the arena
        assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()  # and the next one follows
        # every page faulted in at startup (left to the first request, the faults cost it up to seconds)
        assert _smaps_kb(k, "Rss") * 1024 >= k.numel() * k.element_size()
        m = llm.engine.model
        ptrs = [t.data_ptr() for t in (*m.parameters(), *m.buffers()) if t.layout == torch.strided]
        assert min(ptrs) % memory.HUGE_PAGE_BYTES == 0  # the weights arena's first tensor
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == plain


@pytest.mark.skipif(os.environ.get("KVSERVE_HUGE_PAGES") == "0", reason="huge pages switched off")
def test_int8_kv_cache_in_huge_pages():
    llm = tiny_llm(kv_cache_memory="8MiB", kv_cache_dtype="int8")
    k, _ = llm.engine.runner.kv_caches[0]
    if memory.huge_pages_enabled():
        assert k.codes.data_ptr() % memory.HUGE_PAGE_BYTES == 0  # codes and scales in one arena
        assert k.scale.data_ptr() == k.codes.data_ptr() + k.codes.numel()
    out = llm.generate([[5, 9, 33]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.skipif(os.environ.get("KVSERVE_HUGE_PAGES") == "0", reason="huge pages switched off")
def test_draft_model_weights_in_huge_pages():
    """A draft model's decode steps stream its weights as the target's do: they move into an arena too."""
    llm = tiny_llm(speculative_method="draft", draft_model="tiny-llama", draft_load_format="dummy",
                   num_speculative_tokens=2, kv_cache_memory="8MiB")
    draft = llm.engine.speculator.proposer.runner.model
    ptrs = [t.data_ptr() for t in (*draft.parameters(), *draft.buffers()) if t.layout == torch.strided]
    if memory.huge_pages_enabled():
        assert min(ptrs) % memory.HUGE_PAGE_BYTES == 0  # the draft's own weights arena
        assert min(ptrs) != min(t.data_ptr() for t in llm.engine.model.parameters())
    out = llm.generate([[5, 9, 33]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.skipif(os.environ.get("KVSERVE_HUGE_PAGES") == "0", reason="huge pages switched off")
def test_model_to_huge_pages_gives_the_originals_pages_back():
    """The originals are freed as they are copied, and their pages must leave the process: glibc keeps
    freed heap chunks resident (holes below live allocations are never trimmed on free), which cost a
    speculative SmolLM2 draft +0.5 GiB of RSS. 3000 weights of 64 KiB (heap-sized) with a small live
    allocation after each, so every freed weight is such a hole."""
    if not memory.huge_pages_enabled():
        pytest.skip("no MADV_HUGEPAGE")

    def rss_mib() -> float:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024

    model = torch.nn.Module()
    model.w = torch.nn.ParameterList()
    keep = []
    for _ in range(3000):
        model.w.append(torch.nn.Parameter(torch.ones(16384)))  # 64 KiB each, 188 MiB in all
        keep.append(torch.ones(16))  # pins the heap above each weight
    gc.collect()
    before = rss_mib()
    moved = memory.model_to_huge_pages(model)
    assert moved == 3000 * 16384 * 4
    assert rss_mib() - before < 0.25 * moved / 2**20  # the copies are new pages; the originals' went back
    assert all(float(p.sum()) == 16384 for p in model.w)
