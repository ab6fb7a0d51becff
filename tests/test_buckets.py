"""Stepping the first n of B slots (the decoder's buckets) on the CPU: the same codes as a decoder of batch n, and
slots n.. left exactly as they were; and a dropped decoder's state goes with it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from higgs_rt.generate import Decoder, bucket_sizes
from higgs_rt.prompt import PromptBuilder
from higgs_rt.sampling import SamplingParams
from higgs_rt.talker import Talker

TEXTS = ["Bucketed steps run the lowest slots.", "A second voice joins.", "Third.", "And a fourth one speaks."]


@pytest.fixture(scope="module")
def talker_and_prompts(random_model):
    talker = Talker.from_pretrained(random_model, dtype=torch.float32, device="cpu", max_positions=256)
    builder = PromptBuilder(random_model, talker.cfg.audio_out_token_id)
    return talker, [builder.tts(t) for t in TEXTS]


def run(decoder: Decoder, prompts, n: int, steps: int) -> torch.Tensor:
    q = decoder.talker.cfg.num_codebooks
    frames = torch.full((n, q), decoder.talker.cfg.stream_eos_id, dtype=torch.long)
    for slot, prompt in enumerate(prompts):
        frames[slot] = decoder.start(slot, prompt, SamplingParams(seed=slot + 5))
    out = []
    for _ in range(steps):
        frames = decoder.steps[n](frames)
        out.append(frames.clone())
    return torch.stack(out)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1] and bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("n,batch", [(1, 4), (2, 4), (2, 8), (4, 8)])
def test_stepping_n_of_b_slots_equals_a_decoder_of_batch_n(talker_and_prompts, n, batch):
    talker, prompts = talker_and_prompts
    small = Decoder(talker, batch=n, context=256)
    want = run(small, prompts[:n], n, 24)
    big = Decoder(talker, batch=batch, context=256)
    parked = prompts[-1]
    big.start(batch - 1, parked, SamplingParams(seed=99))  # a slot outside the bucket keeps its state
    k_before, len_before = big.cache.k[:, n:].clone(), big.cache.lengths[n:].clone()
    frame_before = big.sampler.frame[n:].clone()
    got = run(big, prompts[:n], n, 24)
    assert torch.equal(got, want) and bool((want != talker.cfg.stream_eos_id).any())
    assert torch.equal(big.cache.lengths[:n], small.cache.lengths)
    assert torch.equal(big.cache.k[:, :n, :, :256], small.cache.k)
    assert torch.equal(big.cache.k[:, n:], k_before) and torch.equal(big.cache.lengths[n:], len_before)
    assert torch.equal(big.sampler.frame[n:], frame_before)


def test_bucket_for_rows(talker_and_prompts):
    decoder = Decoder(talker_and_prompts[0], batch=8, context=64)
    assert [decoder.bucket(r) for r in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceed"):
        decoder.bucket(9)


def test_a_dropped_decoder_frees_its_cache_at_once(talker_and_prompts):
    """No reference cycle through the decoder's own step: `del` frees the cache (tens of GB at 64 slots), not the
    garbage collector some time later."""
    decoder = Decoder(talker_and_prompts[0], batch=4, context=64)
    frames = run(decoder, talker_and_prompts[1], 4, 2)  # it works after the change, through every bucket's step
    assert frames.shape == (2, 4, decoder.talker.cfg.num_codebooks)
    cache = weakref.ref(decoder.cache)
    gc.disable()
    try:
        del decoder
        assert cache() is None
    finally:
        gc.enable()
