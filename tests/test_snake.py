"""The snake op (higgs_rt.ops.snake: the codec's activation, masked, channels last) against its torch reference
and `codec.layers.Snake`: values, strided inputs, masks, shapes and errors. CPU always; CUDA where present (there
the kernel rounds each step as torch does: bit for bit)."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.codec.layers import Snake
from higgs_rt.ops import HAS_EXTENSION, snake, snake_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def inputs(b: int, t: int, c: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, t + 3, c, generator=g) * 4).to(device)[:, 2: t + 2]  # strided: rows t + 3 apart
    alpha = torch.rand(c, generator=g) * 3 + 0.05
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return x, alpha.to(device), mask.to(device)


def assert_matches(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
    if device == "cuda":
        assert torch.equal(got, want)
    else:  # the C++ kernel's std::sin against torch's vectorized sin: an ulp apart at most
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-6)


@pytest.mark.skipif(not HAS_EXTENSION, reason="needs the compiled library")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,t,c", [(1, 1, 4), (3, 17, 32), (2, 5, 7), (4, 33, 64)])
def test_snake_matches_the_reference(device, b, t, c):
    x, alpha, mask = inputs(b, t, c, device)
    assert t == 1 or not x.is_contiguous()
    assert_matches(snake(x, alpha), snake_ref(x, alpha), device)
    got = snake(x, alpha, mask)
    assert_matches(got, snake_ref(x, alpha, mask), device)
    assert torch.all(got[mask == 0] == 0) and torch.any(got != 0)


@pytest.mark.skipif(not HAS_EXTENSION, reason="needs the compiled library")
@pytest.mark.parametrize("device", DEVICES)
def test_snake_is_the_codec_module_channels_last(device):
    x, alpha, _ = inputs(2, 40, 16, device, seed=1)
    module = Snake(16).to(device)
    with torch.no_grad():
        module.alpha.copy_(alpha.view(1, -1, 1))
        want = module(x.transpose(1, 2)).transpose(1, 2)
    assert_matches(snake(x, alpha), want.contiguous(), device)


def test_snake_rejects_bad_input():
    x, alpha, mask = inputs(2, 5, 8, "cpu")
    with pytest.raises(ValueError, match=r"snake: x must be a float32 \[B, T, C\] tensor, got torch.float64"):
        snake(x.double(), alpha)
    with pytest.raises(ValueError, match=r"snake: x must be a float32 \[B, T, C\]"):
        snake(x[0], alpha)
    with pytest.raises(ValueError, match=r"snake: alpha must be \[8\] \(x's channels\), got \(7,\)"):
        snake(x, alpha[:7])
    with pytest.raises(ValueError, match=r"snake: mask must be float32 \[2, 5\], got torch.float32 \(2, 4\)"):
        snake(x, alpha, mask[:, :4])
    with pytest.raises(ValueError, match=r"snake: mask must be float32 \[2, 5\], got torch.bool"):
        snake(x, alpha, mask.bool())
