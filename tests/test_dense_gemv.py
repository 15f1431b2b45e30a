"""kvserve's float32 GEMV (dense_gemv.c, kvserve/models/linear.py) against a float64 matmul, its
batch invariance, and which products reach it."""
import pytest
import torch
import torch.nn.functional as F

from kvserve.models.linear import GEMV_MAX_ROWS, Linear, gemv_kernel, linear, uses_gemv

needs_kernel = pytest.mark.skipif(gemv_kernel() is None, reason="the dense GEMV needs AVX-512 or AVX2, and cc")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The worst-case rounding error of any float32 summation order of a K-term dot product:
    K · 2^-24 · Σ|x_k w_k| (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), plus the
    rounding of the result."""
    K = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T
    return (K + 1) * 2.0 ** -24 * mag + 1e-30


@needs_kernel
@pytest.mark.parametrize("K", [16, 17, 31, 64, 576, 1000])
@pytest.mark.parametrize("N", [1, 3, 4, 5, 64, 257])
def test_gemv_against_float64(K, N):
    """Every row count of a decode step (1 .. GEMV_MAX_ROWS), widths with and without a 16-lane tail,
    outputs with and without a partial block of 4 rows: within the float32 summation bound of the
    float64 product."""
    g = torch.Generator().manual_seed(K * 1000 + N)
    w = torch.randn(N, K, generator=g)
    for M in (1, 2, 3, 4, 5, 8, GEMV_MAX_ROWS):
        x = torch.randn(M, K, generator=g)
        assert uses_gemv(x, w)
        y = linear(x, w)
        assert y.shape == (M, N) and y.dtype == torch.float32
        err = (y.double() - x.double() @ w.double().T).abs()
        assert (err <= _bound(x, w)).all(), f"M={M}: max error {err.max().item():.3g}"


@needs_kernel
def test_gemv_rows_do_not_depend_on_the_batch():
    """A row's product is the same bits alone and beside other rows (the summation order depends only on
    K), and the same on one thread as on two."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3072, 576, generator=g)
    x = torch.randn(GEMV_MAX_ROWS, 576, generator=g)
    batch = linear(x, w)
    for i in (0, 1, 5, GEMV_MAX_ROWS - 1):
        assert torch.equal(linear(x[i:i + 1], w), batch[i:i + 1])
    assert torch.equal(linear(x[3:7], w), batch[3:7])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, w), batch)
    finally:
        torch.set_num_threads(threads)


def test_other_products_run_pytorch():
    """More rows than a decode step, bfloat16, a transposed weight, or a gradient wanted: F.linear, bit for
    bit."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g)
    cases = [(torch.randn(GEMV_MAX_ROWS + 1, 64, generator=g), w),
             (torch.randn(2, 64, generator=g).bfloat16(), w.bfloat16()),
             (torch.randn(2, 40, generator=g), w.T),  # a [64, 40] view: not contiguous
             (torch.randn(2, 64, generator=g), w.clone().requires_grad_())]
    for x, wt in cases:
        assert not uses_gemv(x, wt)
        assert torch.equal(linear(x, wt), F.linear(x, wt))
    x, wt = cases[-1]
    y = linear(x, wt)
    y.sum().backward()
    assert wt.grad is not None and torch.allclose(wt.grad, x.sum(0).expand(40, 64))


def test_linear_module_is_nn_linear():
    """Same parameters and state dict as nn.Linear; the bias is added; its output equals F.linear within
    the summation bound."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(48, 20)
    mod = Linear(48, 20)
    mod.load_state_dict(ref.state_dict())
    assert isinstance(mod, torch.nn.Linear) and mod.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 48)
    with torch.inference_mode():
        y, want = mod(x), ref(x)
    assert (y - want).abs().max().item() <= 1e-5
    with torch.inference_mode():
        assert torch.equal(mod(x), linear(x, mod.weight) + mod.bias)


@needs_kernel
@pytest.mark.parametrize("K,N", [(17, 5), (64, 3), (352, 96), (1000, 257)])
def test_int8_gemv_against_float64_and_torch(K, N):
    """Int8Linear's decode rows on the GEMV: (Σ x·q)·s rounded to bfloat16, so within half a bfloat16 step
    of |y| plus the float32 summation bound of the float64 product of the dequantized weights; and
    within one bfloat16 step of torch._weight_int8pack_mm on the same codes (the same product, summed in
    another order) where that kernel runs."""
    from kvserve.models.quant import Int8Linear, int8_gemv
    g = torch.Generator().manual_seed(K + N)
    layer = Int8Linear(torch.randn(N, K, generator=g), dense_prefill=False)
    w = layer.dequantize()
    for M in (1, 2, 5, 11):
        x = torch.randn(M, K, generator=g).bfloat16()
        y = layer(x)  # bf16 rows below dense_min_tokens: the packed kernel
        assert torch.equal(y, int8_gemv(x, layer.qweight, layer.scales))
        ref = x.double() @ w.double().T
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2.0 ** -8 + _bound(x.float(), w)).all()
        if K % 16:  # torch's kernel crashes there (kvserve keeps such matrices float: int8_packable)
            continue
        theirs = torch._weight_int8pack_mm(x, layer.qweight, layer.scales).double()
        assert ((y.double() - theirs).abs() <= torch.maximum(y.double().abs(), theirs.abs()) * 2.0 ** -7 + 1e-6).all()
    batch = int8_gemv(x, layer.qweight, layer.scales)
    assert all(torch.equal(int8_gemv(x[i:i + 1], layer.qweight, layer.scales), batch[i:i + 1]) for i in range(len(x)))


@needs_kernel
@pytest.mark.parametrize("K", [17, 100])
def test_int8_many_rows_of_a_width_torch_cannot_take_run_on_the_gemv(K):
    """Found by attacking it: with no bfloat16 copy (dense_prefill=False, or a CPU without oneDNN bf16)
    more than GEMV_MAX_ROWS rows went to torch._weight_int8pack_mm, which dies of a segmentation fault
    when K % 16 != 0. They run on the GEMV in blocks of GEMV_MAX_ROWS rows instead: each row the bits it
    gets alone."""
    from kvserve.models.quant import Int8Linear, int8_gemv
    g = torch.Generator().manual_seed(K)
    layer = Int8Linear(torch.randn(32, K, generator=g), dense_prefill=False)
    x = torch.randn(2 * GEMV_MAX_ROWS + 5, K, generator=g).bfloat16()
    y = layer(x)
    assert y.shape == (x.shape[0], 32)
    assert all(torch.equal(int8_gemv(x[i:i + 1], layer.qweight, layer.scales), y[i:i + 1]) for i in (0, 40, len(x) - 1))


def test_what_the_kernel_cannot_take_goes_to_pytorch():
    """Found by attacking it: mismatched widths (read past each weight row), K = 0 (a division by zero),
    meta and fake tensors (no data), a lazy negation bit, forward-mode AD and autocast all reach F.linear,
    with its results and its errors."""
    import torch.autograd.forward_ad as fwAD
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvserve.models.quant import Int8Linear

    g = torch.Generator().manual_seed(6)
    w = torch.randn(37, 50, generator=g)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear(torch.randn(3, 49, generator=g), w)
    with pytest.raises(RuntimeError):
        Int8Linear(torch.randn(37, 64, generator=g), dense_prefill=False)(torch.randn(1, 48).bfloat16())
    assert torch.equal(linear(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))
    with torch.device("meta"):
        y = Linear(64, 32)(torch.empty(2, 64))
    assert y.shape == (2, 32) and y.device.type == "meta"
    with FakeTensorMode():
        assert linear(torch.empty(2, 64), torch.empty(32, 64)).shape == (2, 32)
    x = torch.randn(2, 50, generator=g)
    neg = torch._neg_view(x)
    assert not uses_gemv(neg, w) and torch.equal(linear(neg, w), F.linear(neg, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w).dtype == torch.bfloat16
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        tangent = fwAD.unpack_dual(linear(dual, w)).tangent
    assert tangent is not None and torch.allclose(tangent, torch.ones(2, 50) @ w.T)
