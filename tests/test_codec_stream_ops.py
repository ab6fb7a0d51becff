"""The streaming codec's fused steps (higgs_rt.ops.codec_window, tap_sum) against their torch references: what the
references compute (spelled out element by element on the CPU), the CUDA kernels' bits against them (vector and
scalar paths, strided inputs, every optional part), and the errors on bad input."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.ops import HAS_CUDA_KERNELS, codec_window, codec_window_ref, snake_ref, tap_sum, tap_sum_ref

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_CUDA_KERNELS),
                                reason="needs a CUDA GPU and a CUDA build of higgs-rt")


def window_inputs(b: int, w: int, c: int, keep: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, w + 3, c, generator=g) * 3)[:, 1: w + 1]  # strided rows
    addend = torch.randn(b, keep + w, c, generator=g)[:, keep:]  # a residual: a slice of the unit's window
    state = torch.randn(b + 2, keep, c, generator=g)  # more lanes than stepped
    first = torch.tensor([-3, 0, 5, 2, 9][:b], dtype=torch.int64)
    length = torch.tensor([4, 1, 6, 50, 0][:b], dtype=torch.int64)
    alpha = torch.rand(c, generator=g) * 3 + 0.05
    alpha_full = torch.rand(c, generator=g) * 3 + 0.05
    return [t.to(device) for t in (x, addend, state, first, length, alpha, alpha_full)]


def test_the_window_reference_spelled_out():
    b, w, c, keep, rate, lag = 4, 6, 3, 2, 2, 3
    x, addend, state, first, length, alpha, alpha_full = window_inputs(b, w, c, keep)
    full, snaked = codec_window_ref(x, state, first, length, rate, lag, addend, alpha, alpha_full)
    assert full.shape == snaked.shape == (b, keep + w, c)
    for lane in range(b):
        assert torch.equal(full[lane, :keep], state[lane])
        for t in range(w):
            pos = int(first[lane]) * rate - lag + t
            inside = 0 <= pos < int(length[lane]) * rate
            want = snake_ref((x[lane, t] + addend[lane, t])[None, None], alpha)[0, 0] if inside else torch.zeros(c)
            assert torch.equal(full[lane, keep + t], want), (lane, t)
    assert torch.equal(snaked, snake_ref(full, alpha_full))
    plain, none = codec_window_ref(x, state, first, length, rate, lag)
    assert none is None and torch.equal(plain[:, keep:], x * (full[:, keep:] != 0).any(-1, keepdim=True))


def test_the_tap_sum_reference_spelled_out():
    g = torch.Generator().manual_seed(3)
    p, bias, alpha = torch.randn(5, 7, 6, generator=g), torch.randn(6, generator=g), torch.rand(6, generator=g) + .1
    s = (((p[0] + p[1]) + p[2]) + p[3]) + p[4]
    assert torch.equal(tap_sum_ref(p), s[None])
    assert torch.equal(tap_sum_ref(p, bias, alpha), snake_ref((s + bias)[None], alpha))
    torch.testing.assert_close(tap_sum(p, bias), (p.sum(0) + bias)[None])  # the CPU runs the reference


@needs_cuda
@pytest.mark.parametrize("b,w,c,keep", [(1, 8, 64, 6), (3, 5, 32, 18), (2, 7, 7, 4), (5, 16, 12, 1), (1, 1, 8, 54)])
@pytest.mark.parametrize("parts", ["plain", "snake", "residual", "all"])
def test_codec_window_kernel_gives_the_reference_bits(b, w, c, keep, parts):
    x, addend, state, first, length, alpha, alpha_full = window_inputs(b, w, c, keep, "cuda", seed=b + w)
    kwargs = {"addend": addend if parts in ("residual", "all") else None,
              "alpha": alpha if parts in ("snake", "all") else None,
              "alpha_full": alpha_full if parts in ("residual", "all") else None}
    for rate, lag in ((1, 0), (3, 2), (8, 13)):
        got = codec_window(x, state, first, length, rate, lag, **kwargs)
        want = codec_window_ref(x, state, first, length, rate, lag, **kwargs)
        assert got[0].shape == (b, keep + w, c) and got[0].is_contiguous()
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.equal(got[1], want[1]))


@needs_cuda
@pytest.mark.parametrize("k,w,c", [(7, 8, 64), (2, 64, 32), (7, 3, 7), (1, 5, 4), (3, 1000, 16)])
def test_tap_sum_kernel_gives_the_reference_bits(k, w, c):
    g = torch.Generator().manual_seed(k * w)
    p = (torch.randn(k, w, c, generator=g) * 10).cuda()
    bias, alpha = torch.randn(c, generator=g).cuda(), (torch.rand(c, generator=g) * 3 + 0.05).cuda()
    for args in ((), (bias,), (None, alpha), (bias, alpha)):
        got = tap_sum(p, *args)
        assert got.shape == (1, w, c) and torch.equal(got, tap_sum_ref(p, *args))


def test_codec_window_rejects_bad_input():
    x, addend, state, first, length, alpha, _ = window_inputs(2, 5, 8, 3)
    with pytest.raises(ValueError, match=r"codec_window: x must be a float32 \[B, W, C\] tensor, got torch.float64"):
        codec_window(x.double(), state, first, length, 1, 0)
    with pytest.raises(ValueError, match=r"codec_window: state must be \[>= 2, keep, 8\], got \(4, 3, 7\)"):
        codec_window(x, state[..., :7], first, length, 1, 0)
    with pytest.raises(ValueError, match=r"codec_window: first and length must be \[2\], got \(1,\) and \(2,\)"):
        codec_window(x, state, first[:1], length, 1, 0)
    with pytest.raises(ValueError, match=r"codec_window: first must be int64"):
        codec_window(x, state, first.int(), length, 1, 0)
    with pytest.raises(ValueError, match=r"codec_window: rate must be >= 1 and lag >= 0, got 0 and 0"):
        codec_window(x, state, first, length, 0, 0)
    with pytest.raises(ValueError, match=r"codec_window: addend must be float32 \(2, 5, 8\)"):
        codec_window(x, state, first, length, 1, 0, addend=addend[:, :4])
    with pytest.raises(ValueError, match=r"codec_window: alpha must be \[8\] \(x's channels\), got \(7,\)"):
        codec_window(x, state, first, length, 1, 0, alpha=alpha[:7])


def test_tap_sum_rejects_bad_input():
    p = torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match=r"tap_sum: products must be float32, got float64"):
        tap_sum(p.double())
    with pytest.raises(ValueError, match=r"tap_sum: products must have 3 dims"):
        tap_sum(p[0])
    with pytest.raises(ValueError, match=r"tap_sum: products must hold at least one tap"):
        tap_sum(p[:0])
    with pytest.raises(ValueError, match=r"tap_sum: bias must be \[8\] \(the products' channels\), got \(3,\)"):
        tap_sum(p, torch.randn(3))
