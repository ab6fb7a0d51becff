"""Per-frame sampling of all codebooks, the delay-pattern state machine and repetition-aware sampling.

Everything is a device tensor op with static shapes: no host sync, safe to compile and to graph.

Noise is counter-based: a pure function of (slot seed, frame, codebook, draw, vocabulary index) computed with
32-bit integer hashing, turned into Gumbel noise. Sampling is Gumbel-max over the filtered logits, which
draws from the same distribution as softmax sampling, and gives the same codes for the same seed in eager,
compiled, graphed and exported runs.

Ramp-in and ramp-out follow the transformers reference (HiggsAudioV2DelayPatternLogitsProcessor): frame t
< Q forces codebooks k >= t to stream BOS; once any codebook emits EOS in frame r, frame r + j forces
codebooks 0..j-1 to EOS; the first all-EOS frame ends the utterance. (Boson's original engine instead ends
7 - j frames after the lowest codebook j that emitted EOS; transformers is the parity oracle.)
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from . import ops
from .host_copy import to_device
from .params import SamplingParams

__all__ = ["FrameSampler", "SamplingParams", "filter_logits", "gumbel_noise"]

MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2**32).

    Multipliers stay below 2**31, so every product fits in int64 exactly (no wraparound to rely on) and
    compiled kernels never meet a constant outside int32.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: Tensor, frame: Tensor, draw: int, num_codebooks: int, vocab: int) -> Tensor:
    """Gumbel noise [B, Q, V] (fp32) from seeds [B] and frame indices [B], both int64."""
    seeds = seeds.to(torch.int64)
    h = _mix32(_mix32(seeds >> 32 & MASK32) ^ (seeds & MASK32))
    h = _mix32(h ^ (frame.to(torch.int64) & MASK32))
    codebook = torch.arange(num_codebooks, device=seeds.device, dtype=torch.int64)
    h = _mix32(h[:, None] ^ (codebook * 4 + draw))                                # [B, Q]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32((h[..., None] + idx) & MASK32)                                   # [B, Q, V]
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))                  # (0, 1)
    return -torch.log(-torch.log(u))


def filter_logits(scores: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus), as transformers' warpers; per-slot settings [B].

    top_k 0 and top_p 1 are off. At least one candidate always survives.
    """
    scores = scores / temperature.clamp_min(1e-5)[:, None, None]
    sorted_desc, _ = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_desc.gather(-1, (k - 1)[:, None, None].expand(-1, scores.shape[1], 1))
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # nucleus over what top-k kept: drop the low tail whose total mass is <= 1 - top_p
    sorted_asc, _ = scores.sort(dim=-1)
    cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p)[:, None, None]
    drop[..., -1] = False
    n_drop = drop.sum(dim=-1, keepdim=True)
    threshold = sorted_asc.gather(-1, n_drop.clamp(max=vocab - 1))
    return scores.masked_fill(scores < threshold, float("-inf"))


class FrameSampler:
    """Device-side decoding state of `batch` slots and the per-frame sampling step.

    State per slot: seed, frame index, frame of the first EOS (-1 = none yet), done flag, a ring of the last
    `ras_window` frames for RAS, and the sampling settings, all tensors so slots can differ without recompiles.
    STATE declares them (attribute -> written by a step): all [B] (history [B, W, Q]) int64, bool or fp32 as
    allocated below; exported steps take exactly these as inputs (`higgs_rt.compiled.step_state`).
    """

    STATE = {"seeds": False, "frame": True, "eos_start": True, "done": True, "history": True, "temperature": False,
             "top_k": False, "top_p": False, "greedy": False, "ras_on": False, "ras_max": False}

    def __init__(self, batch: int, num_codebooks: int, num_codes: int, device, ras_window: int = 7):
        self.q, self.bos, self.eos = num_codebooks, num_codes, num_codes + 1
        self.vocab = num_codes + 2
        self.window = ras_window
        z = dict(device=device)
        self.seeds = torch.zeros(batch, dtype=torch.int64, **z)
        self.frame = torch.zeros(batch, dtype=torch.int64, **z)
        self.eos_start = torch.full((batch,), -1, dtype=torch.int64, **z)
        self.done = torch.ones(batch, dtype=torch.bool, **z)  # a slot is idle until reset
        self.history = torch.full((batch, max(ras_window, 1), num_codebooks), self.bos, dtype=torch.int64, **z)
        self.temperature = torch.ones(batch, **z)
        self.top_k = torch.zeros(batch, dtype=torch.int64, **z)
        self.top_p = torch.ones(batch, **z)
        self.greedy = torch.zeros(batch, dtype=torch.bool, **z)
        self.ras_on = torch.zeros(batch, dtype=torch.bool, **z)
        self.ras_max = torch.full((batch,), 2, dtype=torch.int64, **z)
        self.codebooks = torch.arange(num_codebooks, device=device)

    @property
    def batch(self) -> int:
        return self.seeds.shape[0]

    def rows(self, n: int) -> "FrameSampler":
        """Slots 0..n-1 as a sampler of batch n whose state tensors are views of this one's (a step on it advances
        those slots here)."""
        if n == self.batch:
            return self
        view = copy.copy(self)
        for name in self.STATE:
            setattr(view, name, getattr(self, name)[:n])
        return view

    def reset(self, slot: int, params: SamplingParams, prompt_frames: Tensor | None = None) -> Tensor:
        """Start a new utterance in `slot` and return its frame 0 [Q].

        Prompts end with <|audio_out_bos|>, so the ramp forces frame 0 to all stream-BOS: it needs no logits,
        and the slot's next sampled frame is frame 1. The prompt's last audio frames seed the RAS window, as
        in transformers, where the window reads the prompt's audio frames too.
        """
        params.validate()
        if params.ras_window not in (0, self.window):
            raise ValueError(f"ras_window must be 0 (off) or this engine's window {self.window}, "
                             f"got {params.ras_window}")
        # fills (kernels), not `t[slot] = value`, which copies value from pageable memory and so waits for the
        # stream: the decode loop would lose its step in flight on every admission
        for state, value in ((self.seeds, params.seed), (self.frame, 1), (self.eos_start, -1), (self.done, False),
                             (self.temperature, max(params.temperature, 1e-5)), (self.greedy, params.temperature == 0),
                             (self.top_k, params.top_k), (self.top_p, params.top_p),
                             (self.ras_on, params.ras_window > 0), (self.ras_max, params.ras_max_repeat),
                             (self.history, self.bos)):  # BOS entries never count as repeats
            state[slot].fill_(value)
        if prompt_frames is not None and params.ras_window > 0:
            tail = to_device(prompt_frames[-params.ras_window:], self.history.device)
            for j in range(1, tail.shape[0] + 1):  # prompt frame -j lives where frame -j would in the ring
                self.history[slot, (-j) % self.window] = tail[-j]
            self.history[slot, 0].fill_(self.bos)  # frame 0 evicts the oldest prompt frame
        return torch.full((self.q,), self.bos, dtype=torch.int64, device=self.seeds.device)

    def step(self, logits: Tensor, lengths: Tensor) -> Tensor:
        """logits [B, Q, V] (fp32, raw) -> the next frame [B, Q]; advances the state and the KV `lengths` of the
        slots that were running (not done). On CUDA one fused kernel pair (`ops.sample_frame`) does it all;
        elsewhere, and inside `ops.references()`, the torch code of `__call__`, which is its reference."""
        if ops.sample_frame_supported(logits):
            return ops.sample_frame(logits, self.seeds, self.frame, self.eos_start, self.done, self.history,
                                    self.temperature, self.top_k, self.top_p, self.greedy, self.ras_on,
                                    self.ras_max, lengths, self.window)
        lengths.add_((~self.done).long())
        return self(logits)

    def __call__(self, logits: Tensor) -> Tensor:
        """logits [B, Q, V] (fp32, raw) -> the next frame [B, Q]; advances the state (torch reference)."""
        b = logits.shape[0]
        t = self.frame
        force_bos = self.codebooks[None] >= t[:, None]
        started = self.eos_start >= 0
        force_eos = started[:, None] & (self.codebooks[None] < (t - self.eos_start)[:, None])
        force_eos |= self.done[:, None]
        vocab_ids = torch.arange(self.vocab, device=logits.device)
        scores = logits.masked_fill(force_bos[..., None] & (vocab_ids != self.bos), float("-inf"))
        scores = scores.masked_fill(force_eos[..., None] & (vocab_ids != self.eos), float("-inf"))

        filtered = filter_logits(scores, self.temperature, self.top_k, self.top_p)
        sampled = (filtered + gumbel_noise(self.seeds, t, 0, self.q, self.vocab)).argmax(dim=-1)
        picked = torch.where(self.greedy[:, None], scores.argmax(dim=-1), sampled)

        if self.window:
            hist = self.history
            counted = (hist != self.bos) & (hist != self.eos)
            repeats = ((hist == picked[:, None]) & counted).sum(dim=1)
            redraw = self.ras_on[:, None] & (repeats >= self.ras_max[:, None])
            fresh = (logits + gumbel_noise(self.seeds, t, 1, self.q, self.vocab)).argmax(dim=-1)
            picked = torch.where(redraw, fresh, picked)
        picked = torch.where(self.done[:, None], torch.full_like(picked, self.eos), picked)

        if self.window:
            rows = torch.arange(b, device=logits.device)
            self.history[rows, t % self.window] = picked
        any_eos = (picked == self.eos).any(dim=-1)
        self.eos_start.copy_(torch.where(~started & any_eos, t, self.eos_start))
        self.done |= (picked == self.eos).all(dim=-1)
        self.frame.add_(1)
        return picked
