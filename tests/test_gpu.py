"""GPU paths of the runtime: the graphed step against eager, batch slots, and the engine streaming with the codec
on its own CUDA stream (the fused kernels against the torch step: tests/test_fused_step.py). Skipped without
CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_rt import ops
from higgs_rt.config import TalkerConfig
from higgs_rt.fixtures.talker import random_state
from higgs_rt.generate import Decoder, generate
from higgs_rt.prompt import PromptBuilder
from higgs_rt.sampling import SamplingParams
from higgs_rt.talker import Talker
from higgs_rt.weights import map_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def small():
    """Real head size (128) and 1026-entry codebooks, two layers, bf16 on the GPU."""
    hf, state = random_state("small", "cuda", torch.bfloat16, seed=3)
    cfg = TalkerConfig.from_dict(hf)
    talker = Talker.from_weights(cfg, map_weights(state, cfg, torch.bfloat16, "cuda"))
    assert talker.decode_kernels, "the CUDA decode kernels must be in use on this GPU"
    return talker


def test_graphed_step_gives_the_eager_codes(small, tokenizer_dir):
    prompt = PromptBuilder(tokenizer_dir).tts("The graph replays the whole step.")
    params = SamplingParams(seed=21)
    eager = generate(Decoder(small, context=512), prompt, params, max_frames=120).frames
    graphed = generate(Decoder(small, context=512, cuda_graph=True), prompt, params, max_frames=120).frames
    assert eager.shape[0] > 20
    assert torch.equal(eager, graphed)


def test_graphed_batch_slots_follow_their_own_seeds(small, tokenizer_dir):
    builder = PromptBuilder(tokenizer_dir)
    dec = Decoder(small, batch=4, context=512, cuda_graph=True)
    prompts = [builder.tts(f"Slot number {i} speaks.") for i in range(4)]
    frames = torch.stack([dec.start(i, p, SamplingParams(seed=i % 2)) for i, p in enumerate(prompts)])
    out = [frames]
    for _ in range(30):
        frames = dec.step_fn(frames).clone()
        out.append(frames)
    codes = torch.stack(out, 1).cpu()  # [B, T, Q]
    assert all(int(dec.cache.lengths[i]) >= len(prompts[i]) for i in range(4))
    assert not torch.equal(codes[0], codes[1])
    single = generate(Decoder(small, context=512), prompts[0], SamplingParams(seed=0), max_frames=31).frames
    n = min(single.shape[0], 31)
    assert torch.equal(single[:n], codes[0, :n])  # the fused step is batch-invariant


def test_engine_streams_with_the_codec_beside_the_talker(random_model):
    from higgs_rt.engine import TTS

    tts = TTS(random_model, device="cuda", dtype=torch.float32)
    with tts.stream("Streaming on the GPU. A second sentence follows.", seed=4) as stream:
        audio = np.concatenate(list(stream))
    parts = [tts.codec.decode(tts.codec.postprocess(f.cuda())[None])[0] for f in stream.frames]
    np.testing.assert_allclose(audio, torch.cat(parts).cpu().numpy(), atol=1e-4)
    assert stream.stats.first_audio_s is not None


def test_kernels_are_built_for_this_gpu():
    assert ops.HAS_CUDA_KERNELS


def test_graphed_prefill_matches_the_unpadded_prefill(random_model):
    """Prefill graphs per (text, audio) bucket: a replay gives the unpadded eager prefill's logits and keys/values
    (fp32, within float rounding), writes only its own slot, and a bucket's graph serves later prompts."""
    from higgs_rt.prefill import BucketedPrefill

    from test_prefill import prompt

    talker = Talker.from_pretrained(random_model, device="cuda", dtype=torch.float32, max_positions=1024)
    cache = talker.new_cache(2, 1024)
    prefill = BucketedPrefill(talker, cache)
    for i, (text, audio) in enumerate(((30, 0), (40, 0), (70, 5), (20, 64), (20, 65))):
        ids, frames = prompt(talker, text, audio, seed=i)
        want_cache = talker.new_cache(2, 1024)
        want = talker.prefill(want_cache, 1, ids, frames)
        cache.k[:, 0].fill_(7.0)
        got = prefill(cache, 1, ids, frames)
        t = ids.shape[0]
        assert (got - want).abs().max() <= 1e-4
        assert (cache.k[:, 1, :, :t] - want_cache.k[:, 1, :, :t]).abs().max() <= 1e-4
        assert (cache.v[:, 1, :, :t] - want_cache.v[:, 1, :, :t]).abs().max() <= 1e-4
        assert int(cache.lengths[1]) == t and bool((cache.k[:, 0] == 7.0).all())
    assert set(prefill._buckets) == {(32, 0), (64, 0), (96, 64), (32, 64), (32, 128)}
    assert all(b.graph is not None for b in prefill._buckets.values())
    # batched: two prompts of one bucket in one graph, each slot its lone prefill's keys
    batch = [prompt(talker, text, 0, seed=10 + text) for text in (50, 60)]
    prefill.many(cache, [(1, *batch[0]), (0, *batch[1])])
    for slot, (ids, _) in ((1, batch[0]), (0, batch[1])):
        want_cache = talker.new_cache(1, 1024)
        talker.prefill(want_cache, 0, ids)
        t = ids.shape[0]
        assert int(cache.lengths[slot]) == t
        assert (cache.k[:, slot, :, :t] - want_cache.k[:, 0, :, :t]).abs().max() <= 1e-4
    prefill.warm((96,))  # a batch engine's start: the bucket's graph, the slots left empty
    assert prefill._buckets[96, 0].graph is not None and not cache.lengths.any()


@pytest.mark.parametrize("size", ["small", "wide"])
def test_a_prompt_prefills_to_the_same_bits_alone_and_beside_others(size):
    """The server's loaded-vs-alone probe in small: a prompt's keys and values (bf16, graphed) are bit-identical
    whether it is prefilled alone or in one admission with 1, 2 or 5 others of its bucket (each forward has
    `group_of` prompts whatever arrived; with as many rows as arrived, cuBLAS's kernels for other sizes rounded
    otherwise and a request got other codes beside 63 others than alone)."""
    from higgs_rt.prefill import BucketedPrefill

    from test_prefill import prompt

    hf, state = random_state(size, "cuda", torch.bfloat16, seed=5)
    cfg = TalkerConfig.from_dict(hf)
    talker = Talker.from_weights(cfg, map_weights(state, cfg, torch.bfloat16, "cuda"))
    cache = talker.new_cache(8, 256)
    prefill = BucketedPrefill(talker, cache)
    prompts = [prompt(talker, text, 0, seed=30 + text) for text in (46, 50, 61, 40, 55, 58)]
    prefill(cache, 0, *prompts[0])
    t = prompts[0][0].shape[0]
    alone = cache.k[:, 0, :, :t].clone(), cache.v[:, 0, :, :t].clone()
    for others in (1, 2, 5):
        cache.k.zero_(), cache.v.zero_()
        prefill.many(cache, [(7 - j, *prompts[j]) for j in range(others + 1)][::-1])  # the probe last, slot 7
        assert torch.equal(cache.k[:, 7, :, :t], alone[0]) and torch.equal(cache.v[:, 7, :, :t], alone[1]), others


def test_prefill_and_admission_never_wait_for_the_step_in_flight(small):
    """The batch engine's admission (prefill groups of two buckets, a cloned voice's frames from the host, the
    sampler's reset with its RAS window) queues behind the step in flight without the host waiting for the GPU:
    pageable copies drained the stream on every admission tick, and the decode loop lost its step in flight."""
    from higgs_rt.prompt import Prompt

    from test_prefill import prompt

    decoder = Decoder(small, batch=4, context=512, cuda_graph=True)
    prompts = [Prompt(*prompt(small, text, audio, seed=text)) for text, audio in ((40, 0), (50, 0), (30, 20))]
    assert prompts[2].audio_frames is not None and not prompts[2].audio_frames.is_cuda
    starts = [(slot, p, SamplingParams(seed=slot), False) for slot, p in enumerate(prompts)]
    frames = torch.stack(decoder.start_many(starts))  # the buckets' graphs are captured here (a capture waits)
    decoder.step_fn(torch.cat([frames, frames[:1]]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host wait for the stream raises
    try:
        for _ in range(3):
            decoder.step_fn(torch.cat([frames, frames[:1]]))  # steps in flight
        again = decoder.start_many(starts[::-1])
        decoder.release(3)  # a stream's end, also on the decode loop
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(again) == 3 and decoder.cache.lengths[:3].tolist() == [len(p) for p in prompts]


def test_captures_on_two_threads_never_meet():
    """The batch engine captures on its decode thread and its codec thread; a capture starting while the other
    thread's is open must wait for it (torch.cuda.graph's device-wide synchronize there voids both captures)."""
    import threading
    import time

    from higgs_rt.cuda_graph import capture_graph

    x = torch.ones(1024, device="cuda")
    opened, results = threading.Event(), {}

    def slow():
        y = x * 2
        if not opened.is_set():  # the capture itself, not the warm-up: keep it open while the main thread captures
            opened.set()
            time.sleep(0.3)
        return y

    def other():
        try:
            results["other"] = capture_graph(slow, warmup=0)
        except Exception as e:  # surfaced below, on the test's thread
            results["other"] = e

    thread = threading.Thread(target=other)
    thread.start()
    assert opened.wait(10)
    graph, out = capture_graph(lambda: x + 1, warmup=1)
    thread.join(10)
    assert not isinstance(results["other"], Exception), results["other"]
    other_graph, other_out = results["other"]
    graph.replay(), other_graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 2).all()) and bool((other_out == 2).all())
    torch.randn(4, device="cuda")  # the generator is out of capture mode


def test_graphs_sharing_a_pool_reuse_its_memory():
    """Twenty captures of a 64 MB working set into one pool reserve about one's worth, not twenty (each capture on
    a stream of its own kept its blocks from the next: the codec's 100 graphs reserved 27.6 GiB)."""
    from higgs_rt.cuda_graph import capture_graph

    x = torch.ones(4 << 20, device="cuda")
    pool = torch.cuda.graph_pool_handle()

    def work():
        return ((x * 2) + 1).sum()  # 16 MB intermediates, freed inside the capture

    first = capture_graph(work, warmup=1, pool=pool)  # kept: a pool lives while a graph of it does
    before = torch.cuda.memory_reserved()
    graphs = [capture_graph(work, warmup=1, pool=pool) for _ in range(20)]
    assert torch.cuda.memory_reserved() - before < 64 << 20
    for graph, out in [first, *graphs]:
        graph.replay()
        assert float(out) == 3 * x.numel()


def test_a_request_gets_the_same_codes_alone_and_admitted_with_others(random_model):
    """The server's loaded-vs-alone probe without HTTP: a request prefilled in one admission with three others of
    its prompt bucket (batched forwards, CUDA graphs) gets the codes it gets alone."""
    from higgs_rt.batch import BatchEngine
    from higgs_rt.engine import TTS

    engine = BatchEngine(TTS(random_model, device="cuda"), slots=4, queue=8)
    try:
        text, params = "The probe speaks one sentence here.", dict(seed=42, max_frames=40)
        alone = engine.submit(text, **params)
        list(alone)
        with engine._cond:  # all four wait for the same tick's admission
            others = [engine.submit(f"Another voice number {i} talks too.", seed=i, max_frames=40) for i in range(3)]
            probe = engine.submit(text, **params)
        for job in (*others, probe):
            list(job)
        assert any(prompts == 4 for _, prompts, _, _ in engine.ticks)
        assert len(probe.frames) == len(alone.frames) > 0
        assert all(torch.equal(a, b) for a, b in zip(probe.frames, alone.frames))
    finally:
        engine.close()
