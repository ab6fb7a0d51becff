"""Band-limited resampling in pure torch, numerically the same as torchaudio's `functional.resample`.

Owns the windowed-sinc (Hann) resampler of the fixed 24 kHz -> 16 kHz step into the codec's semantic encoder
(its parity with transformers rests on matching torchaudio exactly) and `install_torchaudio_standin()`, which
lets transformers' codec module (it imports torchaudio at import time) load where no torchaudio build matches
torch. Its filter bank has (new rate x old rate) / gcd^2 taps, fine for small ratios such as 3:2 but gigabytes
for rates like 22051 -> 24000: reference audio at arbitrary rates goes through soxr (`higgs_rt.audio_in`), and
a ratio whose bank would pass MAX_KERNEL_TAPS is refused here rather than built.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import torch
import torch.nn.functional as F

__all__ = ["resample", "sinc_resample_kernel", "filter_bank_taps", "install_torchaudio_standin"]

MIN_RATE, MAX_RATE = 8000, 192000  # the sample rates higgs-rt takes in (reference audio) and a codec may have
MAX_KERNEL_TAPS = 1 << 22  # 16 MiB of float32: 24k -> 16k needs 2 x 17, 44.1k -> 24k 80 x 163


def filter_bank_taps(orig_freq: int, new_freq: int, lowpass_filter_width: int = 6, rolloff: float = 0.99) -> int:
    """Taps of the polyphase filter bank `sinc_resample_kernel` builds for these rates (divided by their gcd here)."""
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    return new * (2 * _width(orig, new, lowpass_filter_width, rolloff) + orig)


def _width(orig_freq: int, new_freq: int, lowpass_filter_width: int, rolloff: float) -> int:
    return math.ceil(lowpass_filter_width * orig_freq / (min(orig_freq, new_freq) * rolloff))


def sinc_resample_kernel(
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Polyphase filter bank [new, 1, 2*width + orig] for rates already divided by their gcd, and width.

    Computed in `dtype` (as torchaudio does with the waveform's dtype) so results match it bit for bit.
    """
    if lowpass_filter_width <= 0:
        raise ValueError("lowpass_filter_width must be positive")
    cutoff = min(orig_freq, new_freq) * rolloff
    width = _width(orig_freq, new_freq, lowpass_filter_width, rolloff)
    if new_freq * (2 * width + orig_freq) > MAX_KERNEL_TAPS:
        raise ValueError(f"a {orig_freq}:{new_freq} resampling ratio needs a {new_freq} x {2 * width + orig_freq} "
                         "filter bank: use a resampler whose cost is bounded for any ratio "
                         "(higgs_rt.audio_in.resample_to, soxr)")
    taps = torch.arange(-width, width + orig_freq, dtype=dtype, device=device)[None, None] / orig_freq
    phases = torch.arange(0, -new_freq, -1, dtype=dtype, device=device)[:, None, None] / new_freq
    t = ((phases + taps) * cutoff).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=t.dtype, device=t.device), t.sin() / t)
    return sinc * (window * (cutoff / orig_freq)), width


def resample(
    waveform: torch.Tensor,
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    resampling_method: str = "sinc_interp_hann",
    beta: float | None = None,
) -> torch.Tensor:
    """Resample `waveform[..., time]` from `orig_freq` to `new_freq` Hz (output length ceil(new*len/orig))."""
    if resampling_method != "sinc_interp_hann":
        raise ValueError(f"only resampling_method='sinc_interp_hann' is implemented, got {resampling_method!r}")
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_freq} -> {new_freq}")
    if int(orig_freq) != orig_freq or int(new_freq) != new_freq:
        raise ValueError(f"sample rates must be integers, got {orig_freq} -> {new_freq}")
    if not waveform.is_floating_point():
        raise TypeError(f"waveform must be floating point, got {waveform.dtype}")
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    kernel, width = sinc_resample_kernel(orig, new, lowpass_filter_width, rolloff, waveform.dtype, waveform.device)

    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    length = flat.shape[-1]
    padded = F.pad(flat, (width, width + orig))
    out = F.conv1d(padded[:, None], kernel, stride=orig)  # [N, new, blocks]: phase p of block b is sample b*new+p
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)
    out = out[:, : math.ceil(new * length / orig)]
    return out.reshape(*shape[:-1], out.shape[-1])


def install_torchaudio_standin() -> bool:
    """Register a minimal `torchaudio` (with `functional.resample`) unless the real one imports.

    Returns True when the stand-in was installed (or already is), False when real torchaudio is used.
    """
    current = sys.modules.get("torchaudio")
    if current is not None:
        return bool(getattr(current, "__higgs_rt_standin__", False))
    try:
        import torchaudio  # noqa: F401

        return False
    except Exception:  # ImportError, or OSError from a build that does not match torch
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]

    package = types.ModuleType("torchaudio")
    package.__spec__ = importlib.machinery.ModuleSpec("torchaudio", loader=None, is_package=True)
    package.__path__ = []
    package.__version__ = "0.0.0+higgs_rt_standin"
    package.__higgs_rt_standin__ = True
    functional = types.ModuleType("torchaudio.functional")
    functional.__spec__ = importlib.machinery.ModuleSpec("torchaudio.functional", loader=None)
    functional.resample = resample
    package.functional = functional
    sys.modules["torchaudio"] = package
    sys.modules["torchaudio.functional"] = functional
    return True
