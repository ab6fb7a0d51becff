"""higgs_rt.resample: torchaudio's sinc (Hann) resampler in pure torch, and the torchaudio stand-in."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from higgs_rt.resample import install_torchaudio_standin, resample

RATES = [(24000, 16000), (16000, 24000), (44100, 24000), (22050, 16000), (24000, 8000), (8000, 24000)]


def test_equal_rates_return_the_input():
    x = torch.randn(2, 1000)
    assert resample(x, 24000, 24000) is x


@pytest.mark.parametrize("orig,new", RATES)
@pytest.mark.parametrize("length", [1, 7, 960, 24001])
def test_output_length_is_ceil_of_ratio(orig, new, length):
    out = resample(torch.randn(3, 1, length), orig, new)
    assert out.shape == (3, 1, math.ceil(length * new / orig))


@pytest.mark.parametrize("orig,new", RATES)
def test_sine_below_cutoff_is_preserved(orig, new):
    freq, seconds = 440.0, 0.5
    x = 0.7 * torch.sin(2 * math.pi * freq * torch.arange(int(orig * seconds), dtype=torch.float64) / orig)
    y = resample(x, orig, new)
    expected = 0.7 * torch.sin(2 * math.pi * freq * torch.arange(y.shape[-1], dtype=torch.float64) / new)
    middle = slice(new // 20, -new // 20)  # away from the zero-padded edges
    assert (y[middle] - expected[middle]).abs().max() < 2e-3


def test_matches_the_sinc_formula_directly():
    """y[j] = sum_i x[i] h(i/orig - j/new), h = rolloff-scaled sinc under a Hann window of 6 zero crossings."""
    orig, new, width, rolloff = 3, 2, 6, 0.99
    x = torch.randn(200, dtype=torch.float64)
    y = resample(x, orig, new)
    cutoff = min(orig, new) * rolloff
    for j in (0, 17, 80, y.shape[0] - 1):
        t = ((torch.arange(200, dtype=torch.float64) / orig - j / new) * cutoff).clamp(-width, width)
        h = torch.where(t == 0, 1.0, torch.sin(math.pi * t) / (math.pi * t)) * torch.cos(t * math.pi / width / 2) ** 2
        assert abs(float((x * h).sum() * cutoff / orig) - float(y[j])) < 1e-12


def test_rejects_what_torchaudio_rejects():
    with pytest.raises(ValueError):
        resample(torch.randn(10), 0, 16000)
    with pytest.raises(TypeError):
        resample(torch.arange(10), 24000, 16000)


def test_standin_makes_torchaudio_importable():
    installed = install_torchaudio_standin()
    assert importlib.util.find_spec("torchaudio") is not None
    import torchaudio

    assert installed == bool(getattr(torchaudio, "__higgs_rt_standin__", False))
    if installed:
        assert torchaudio.functional.resample is resample
    from transformers.models.higgs_audio_v2_tokenizer import modeling_higgs_audio_v2_tokenizer  # noqa: F401


def real_torchaudio():
    module = sys.modules.get("torchaudio")
    if module is None:
        try:
            import torchaudio as module
        except Exception as e:  # no build matching this torch
            pytest.skip(f"real torchaudio not importable: {e}")
    if getattr(module, "__higgs_rt_standin__", False):
        pytest.skip("real torchaudio not importable here (the stand-in is installed)")
    return module


@pytest.mark.parametrize("orig,new", RATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_real_torchaudio(orig, new, dtype):
    torchaudio = real_torchaudio()
    x = torch.randn(2, 1, 12345, dtype=dtype, generator=torch.Generator().manual_seed(0))
    expected = torchaudio.functional.resample(x, orig, new)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(resample(x, orig, new), expected, atol=tol, rtol=0)


def test_ratios_with_huge_filter_banks_are_refused_not_built():
    """22051 -> 24000 Hz would need a 24000 x 22065 bank (10.6 GB): refused at once; arbitrary rates use soxr."""
    with pytest.raises(ValueError, match="24000 x 22065 filter bank"):
        resample(torch.randn(22051), 22051, 24000)
    assert resample(torch.randn(24000), 24000, 16000).shape == (16000,)  # the codec's fixed step stays
