"""Sampling: filters against transformers' warpers, counter-based noise, ramp state machine, RAS, seeds."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.generate import Decoder, generate
from higgs_rt.prompt import PromptBuilder
from higgs_rt.sampling import FrameSampler, SamplingParams, filter_logits, gumbel_noise
from higgs_rt.talker import Talker

Q, K = 8, 16
BOS, EOS = K, K + 1


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, Q, 1026, generator=g) * 3
    for temp, k, p in [(1.0, 50, 0.95), (0.7, 5, 0.5), (1.3, 0, 0.9), (1.0, 1026, 1.0), (0.5, 1, 0.3)]:
        want = TemperatureLogitsWarper(temp)(None, logits.view(-1, 1026))
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        n = logits.shape[0]
        got = filter_logits(logits, torch.full((n,), temp), torch.full((n,), k), torch.full((n,), p))
        assert torch.equal(torch.isinf(got).view(-1, 1026), torch.isinf(want)), (temp, k, p)
        kept = ~torch.isinf(want)
        assert torch.allclose(got.view(-1, 1026)[kept], want[kept])
        assert (~torch.isinf(got)).sum(-1).min() >= 1


def test_gumbel_noise_is_a_pure_function_of_its_counters():
    seeds, frame = torch.tensor([1, 2, 2**40 + 1]), torch.tensor([5, 5, 5])
    a = gumbel_noise(seeds, frame, 0, Q, 1026)
    assert a.shape == (3, Q, 1026) and a.dtype == torch.float32
    assert torch.equal(a, gumbel_noise(seeds, frame, 0, Q, 1026))
    assert not torch.equal(a, gumbel_noise(seeds, frame + 1, 0, Q, 1026))
    assert not torch.equal(a, gumbel_noise(seeds, frame, 1, Q, 1026))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])  # the high half of a seed counts
    assert not torch.equal(a[:, 0], a[:, 1])
    # standard Gumbel: mean = Euler-Mascheroni, variance = pi^2 / 6
    assert abs(a.mean().item() - 0.5772) < 0.02
    assert abs(a.var().item() - 1.6449) < 0.05


def test_gumbel_max_samples_the_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    noise = gumbel_noise(torch.arange(n), torch.zeros(n, dtype=torch.long), 0, 1, 4)[:, 0]
    freq = torch.bincount((logits + noise).argmax(-1), minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1), atol=0.015)


def sampler(batch=1, window=7):
    return FrameSampler(batch, Q, K, "cpu", window)


def run(s: FrameSampler, logits_fn, frames: int) -> torch.Tensor:
    out = []
    for t in range(frames):
        out.append(s(logits_fn(t)))
    return torch.stack(out, 1)  # [B, T, Q]


def test_ramp_in_forces_bos_then_frees_all_codebooks():
    s = sampler()
    frame0 = s.reset(0, SamplingParams(seed=3))
    assert frame0.tolist() == [BOS] * Q
    logits = torch.zeros(1, Q, K + 2)
    logits[..., EOS] = -1e9  # no EOS: the ramp-in alone
    frames = run(s, lambda t: logits, 12)[0]
    for i, frame in enumerate(frames, start=1):
        assert (frame[i:] == BOS).all(), i
    assert (frames[Q - 1:] != BOS).float().mean() > 0.9  # free codebooks rarely pick BOS by chance


def test_ramp_out_forces_eos_in_order_and_ends_with_an_all_eos_frame():
    s = sampler()
    s.reset(0, SamplingParams(temperature=0, ras_window=0))
    logits = torch.zeros(1, Q, K + 2)
    logits[..., 3] = 5.0

    def fn(t):
        out = logits.clone()
        if t == 10:  # frame 11: codebook 5 emits EOS
            out[0, 5, EOS] = 10.0
        return out

    frames = run(s, fn, 25)[0]
    r = 11 - 1  # frames[i] is frame i + 1
    assert frames[r, 5] == EOS and (frames[r, :5] == 3).all()
    for j in range(1, Q + 1):
        assert (frames[r + j, :j] == EOS).all(), j
        assert (frames[r + j, j:][torch.arange(Q - j) + j != 5] == 3).all(), j
    assert (frames[r + Q] == EOS).all() and bool(s.done[0])
    assert (frames[r + Q:] == EOS).all()  # a finished slot only emits EOS


def test_ras_redraws_repeats_from_raw_logits():
    logits = torch.zeros(1, Q, K + 2)
    logits[..., 7] = 1.0  # greedy always picks 7; the raw softmax rarely does
    logits[..., BOS] = logits[..., EOS] = -1e9
    off, on = sampler(), sampler()
    off.reset(0, SamplingParams(temperature=0, ras_window=0))
    on.reset(0, SamplingParams(temperature=0, ras_window=7, ras_max_repeat=2, seed=1))
    frames_off = run(off, lambda t: logits, 40)[0, Q:]
    frames_on = run(on, lambda t: logits, 40)[0, Q:]
    assert (frames_off == 7).all()
    assert (frames_on != 7).any()
    # a 7 is only redrawn where the codebook's last 7 codes held at least two 7s
    for t in range(7, frames_on.shape[0]):
        window = frames_on[t - 7:t]
        for k in range(Q):
            if (window[:, k] == 7).sum() < 2:
                assert frames_on[t, k] == 7


def test_ras_window_reads_prompt_frames():
    logits = torch.zeros(1, Q, K + 2)
    logits[..., 7] = 1.0
    logits[..., BOS] = logits[..., EOS] = -1e9
    s = sampler()
    prompt_frames = torch.full((20, Q), 7)
    s.reset(0, SamplingParams(temperature=0, ras_max_repeat=2), prompt_frames)
    first = run(s, lambda t: logits, 1)[0, 0]
    assert first[0] != 7  # codebook 0 is free in frame 1 and six prompt 7s sit in its window


def test_params_are_validated():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(seed=-1),
                dict(ras_max_repeat=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()
    with pytest.raises(ValueError, match="ras_window must be 0"):
        sampler().reset(0, SamplingParams(ras_window=5))


@pytest.fixture(scope="module")
def tiny(talker_dirs):
    hf_dir = talker_dirs["tiny"][0]
    model = Talker.from_pretrained(hf_dir)
    return model, PromptBuilder(hf_dir).tts("Seeds make it repeatable.")


def test_same_seed_repeats_and_different_seeds_differ(tiny):
    model, prompt = tiny
    a = generate(Decoder(model, context=256), prompt, SamplingParams(seed=7), max_frames=40).frames
    b = generate(Decoder(model, context=256), prompt, SamplingParams(seed=7), max_frames=40).frames
    c = generate(Decoder(model, context=256), prompt, SamplingParams(seed=8), max_frames=40).frames
    assert torch.equal(a, b)
    n = min(len(a), len(c))
    assert not torch.equal(a[:n], c[:n])


def test_compiled_step_gives_the_same_codes_as_eager(tiny):
    model, prompt = tiny
    params = SamplingParams(seed=11)
    eager = generate(Decoder(model, context=256), prompt, params, max_frames=30).frames
    dec = Decoder(model, context=256)
    dec.step_fn = torch.compile(dec.step, fullgraph=True)
    assert torch.equal(generate(dec, prompt, params, max_frames=30).frames, eager)


def test_max_frames_cut_is_reported_and_too_few_frames_is_a_usage_error(tiny):
    model, prompt = tiny
    cut = generate(Decoder(model, context=256), prompt, SamplingParams(temperature=0, ras_window=0), max_frames=9)
    assert cut.frames.shape == (9, Q) and not cut.finished
    with pytest.raises(ValueError, match="at least 9"):
        generate(Decoder(model, context=256), prompt, max_frames=8)
    with pytest.raises(ValueError, match="exceeds the context"):
        generate(Decoder(model, context=64), prompt, max_frames=60)


def test_should_stop_ends_generation(tiny):
    model, prompt = tiny
    seen = []
    gen = generate(Decoder(model, context=256), prompt, SamplingParams(seed=1), max_frames=50,
                   on_frame=lambda i, f: seen.append(i), should_stop=lambda: len(seen) >= 4)
    assert gen.stopped and not gen.finished and gen.frames.shape[0] == 4 and seen == [0, 1, 2, 3]
