"""Bucketed prefill (higgs_rt.prefill): a prompt padded to its (text, audio) bucket gives the unpadded prefill's
logits and keys/values, writes only its own slot, and falls back to the eager prefill outside the buckets. On the
CPU the padded forward runs eagerly; tests/test_gpu.py replays it as CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.prefill import (AUDIO_BUCKETS, GROUP_ROWS, GROUP_ROWS_CUDA, TEXT_BUCKETS, BucketedPrefill, bucket_of,
                              group_of, group_rows)
from higgs_rt.talker import Talker

from conftest import TINY_TALKERS

TOL = 1e-5


@pytest.fixture(scope="module")
def talker(talker_dirs):
    return Talker.from_pretrained(talker_dirs[TINY_TALKERS[0]][0], max_positions=1024)


def prompt(talker: Talker, text: int, audio: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`text` text ids around `audio` audio positions (as a clone prompt puts them), and the audio frames."""
    cfg = talker.cfg
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 200, (text,), generator=g)
    assert not talker.audio_mask(words).any()
    head = text // 2
    ids = torch.cat([words[:head], torch.full((audio,), cfg.audio_out_token_id), words[head:]])
    frames = torch.randint(0, cfg.num_codes, (audio, cfg.num_codebooks), generator=g) if audio else None
    return ids, frames


def test_bucket_edges():
    assert [bucket_of(n, TEXT_BUCKETS) for n in (1, 33, 64, 65, 97, 512, 513)] == [32, 64, 64, 96, 128, 512, None]
    assert [bucket_of(n, AUDIO_BUCKETS) for n in (0, 1, 64, 65, 321, 1024, 1025)] == [0, 64, 64, 128, 384, 1024,
                                                                                       None]


CASES = [(1, 0), (63, 0), (64, 0), (65, 0), (128, 0), (129, 0), (20, 1), (20, 64), (20, 65), (64, 64), (65, 65)]


@pytest.mark.parametrize("text,audio", CASES)
@torch.no_grad()
def test_padded_prefill_equals_the_unpadded_one(talker, text, audio):
    ids, frames = prompt(talker, text, audio, seed=text * 1000 + audio)
    t = ids.shape[0]
    want_cache = talker.new_cache(2, 1024)
    want = talker.prefill(want_cache, 1, ids, frames)
    cache = talker.new_cache(2, 1024)
    cache.k.normal_()  # slot 0: another stream's keys and values, which the padded prefill must not touch
    other_k, other_v = cache.k[:, 0].clone(), cache.v[:, 0].clone()
    prefill = BucketedPrefill(talker, cache, graphs=False)
    assert prefill.bucket(ids) == (bucket_of(text, TEXT_BUCKETS), bucket_of(audio, AUDIO_BUCKETS))
    got = prefill(cache, 1, ids, frames)
    assert got.shape == want.shape and (got - want).abs().max() <= TOL
    assert (cache.k[:, 1, :, :t] - want_cache.k[:, 1, :, :t]).abs().max() <= TOL
    assert (cache.v[:, 1, :, :t] - want_cache.v[:, 1, :, :t]).abs().max() <= TOL
    assert int(cache.lengths[1]) == t and int(cache.lengths[0]) == 0
    assert torch.equal(cache.k[:, 0], other_k) and torch.equal(cache.v[:, 0], other_v)


@torch.no_grad()
def test_outside_the_buckets_is_the_eager_prefill(talker):
    cache = talker.new_cache(1, 600)
    prefill = BucketedPrefill(talker, cache, graphs=False)
    ids, _ = prompt(talker, 513, 0, seed=3)  # past the last text bucket
    assert prefill.bucket(ids) is None
    assert torch.equal(prefill(cache, 0, ids), talker.prefill(talker.new_cache(1, 600), 0, ids))
    ids, frames = prompt(talker, 100, 500, seed=4)  # its bucket (128 + 512) is past the cache
    assert prefill.bucket(ids) is None
    with pytest.raises(ValueError, match="another cache"):
        prefill(talker.new_cache(1, 600), 0, ids, frames)


def test_bad_prompts_get_the_prefill_errors(talker):
    cache = talker.new_cache(1, 256)
    prefill = BucketedPrefill(talker, cache, graphs=False)
    ids, frames = prompt(talker, 10, 3, seed=5)
    with pytest.raises(ValueError, match="3 audio positions but 2 audio frames"):
        prefill(cache, 0, ids, frames[:2])
    with pytest.raises(ValueError, match="the prompt has 0 positions"):
        prefill(cache, 0, ids[:0])
    with pytest.raises(ValueError, match="need the model on a CUDA device"):
        BucketedPrefill(talker, cache, graphs=True)


@torch.no_grad()
def test_group_sizes_fill_the_group_rows():
    assert [group_of(key) for key in ((32, 0), (64, 0), (96, 0), (128, 0), (192, 0), (32, 64), (32, 128),
                                      (512, 1024))] == [4, 2, 1, 1, 1, 1, 1, 1]
    assert all(group_of((t, 0)) * t <= GROUP_ROWS for t in TEXT_BUCKETS if t <= GROUP_ROWS)


def test_group_rows_switch(talker, monkeypatch):
    """Positions per forward: 128 on the CPU, 512 on CUDA, or $HIGGS_RT_PREFILL_GROUP_ROWS (a measurement switch); a
    bad value is a clear error at the prefill's construction."""
    cache = talker.new_cache(1, 64)
    assert BucketedPrefill(talker, cache, graphs=False).rows == GROUP_ROWS == 128  # the CPU's; CUDA's is wider
    assert group_rows(torch.device("cuda")) == GROUP_ROWS_CUDA == 512
    monkeypatch.setenv("HIGGS_RT_PREFILL_GROUP_ROWS", "256")
    prefill = BucketedPrefill(talker, cache, graphs=False)
    assert prefill.rows == 256 and group_of((64, 0), prefill.rows) == 4
    for bad in ("0", "-3", "many", ""):
        monkeypatch.setenv("HIGGS_RT_PREFILL_GROUP_ROWS", bad)
        with pytest.raises(ValueError, match="HIGGS_RT_PREFILL_GROUP_ROWS must be a positive number"):
            BucketedPrefill(talker, cache, graphs=False)


def test_a_group_has_no_more_prompts_than_the_cache_has_slots(talker, monkeypatch):
    """A 1-slot cache (`TTS`'s decoder) never has a second prompt to seat: its forwards are one prompt wide, not
    `group_of`'s (which would pad a lone sentence to 2 prompts on the CPU, 8 on CUDA); wider caches keep the
    group."""
    ids, _ = prompt(talker, 40, 0, seed=3)
    monkeypatch.setenv("HIGGS_RT_PREFILL_GROUP_ROWS", "512")
    for slots, group in ((1, 1), (2, 2), (4, 4), (16, 8)):
        prefill = BucketedPrefill(talker, talker.new_cache(slots, 512), graphs=False)
        assert prefill.group(ids) == ((64, 0), group), slots
    prefill(prefill.cache, 0, ids)
    assert prefill._buckets[(64, 0)].ids.shape[0] == 8
    lone = BucketedPrefill(talker, talker.new_cache(1, 512), graphs=False)
    lone(lone.cache, 0, ids)
    assert lone._buckets[(64, 0)].ids.shape[0] == 1


def test_many_prompts_batch_by_bucket_and_equal_the_lone_prefills(talker):
    """`many` (the batch engine's admission): prompts of a bucket share forwards of `group_of` prompts; each slot
    gets the keys and values of its own unpadded prefill, slots not named keep theirs, and a prompt outside the
    buckets runs the eager prefill."""
    lengths = [(40, 0), (50, 0), (60, 0), (20, 70), (30, 0), (25, 0), (30, 0), (31, 0), (29, 0), (20, 66), (513, 0)]
    prompts = [prompt(talker, text, audio, seed=50 + i) for i, (text, audio) in enumerate(lengths)]
    slots = [(3 * i + 1) % 13 for i in range(len(prompts))]  # distinct, out of order
    cache = talker.new_cache(13, 1024)
    cache.k.normal_()
    untouched = [s for s in range(13) if s not in slots]
    other_k = cache.k[:, untouched].clone()
    prefill = BucketedPrefill(talker, cache, graphs=False)
    groups = []
    run = prefill._run
    prefill._run = lambda key, items: groups.append((key, len(items))) or run(key, items)
    assert prefill.many(cache, [(slot, ids, frames) for slot, (ids, frames) in zip(slots, prompts)]) == 7
    assert sorted(groups) == [((32, 0), 1), ((32, 0), 4), ((32, 128), 1), ((32, 128), 1), ((64, 0), 1),
                              ((64, 0), 2)]
    for slot, (ids, frames) in zip(slots, prompts):
        t = ids.shape[0]
        want = talker.new_cache(1, 1024)
        talker.prefill(want, 0, ids, frames)
        assert int(cache.lengths[slot]) == t
        assert (cache.k[:, slot, :, :t] - want.k[:, 0, :, :t]).abs().max() <= TOL, slot
        assert (cache.v[:, slot, :, :t] - want.v[:, 0, :, :t]).abs().max() <= TOL, slot
    assert torch.equal(cache.k[:, untouched], other_k)
    with pytest.raises(ValueError, match="another cache"):
        prefill.many(talker.new_cache(1, 64), [(0, *prompts[0])])


@torch.no_grad()
def test_many_takes_the_groups_its_caller_computed(talker):
    """Given each prompt's `group` (the batch engine's admission has them), `many` computes no bucket again and
    writes the same keys and values as without; a list of another length is refused."""
    sizes = [(40, 0), (50, 0), (20, 70)]
    prompts = [prompt(talker, text, audio, seed=130 + i) for i, (text, audio) in enumerate(sizes)]
    starts = [(slot, ids, frames) for slot, (ids, frames) in enumerate(prompts)]
    want = talker.new_cache(3, 1024)
    BucketedPrefill(talker, want, graphs=False).many(want, starts)
    cache = talker.new_cache(3, 1024)
    prefill = BucketedPrefill(talker, cache, graphs=False)
    groups = [prefill.group(ids) for _, ids, _ in starts]
    bucket, computed = prefill.bucket, []
    prefill.bucket = lambda ids: computed.append(ids) or bucket(ids)
    prefill.many(cache, starts, groups)
    assert computed == [] and torch.equal(cache.lengths, want.lengths)
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)
    with pytest.raises(ValueError, match="2 groups for 3 prompts"):
        prefill.many(cache, starts, groups[:2])


@torch.no_grad()
def test_decoder_start_many_is_start_for_each_slot(talker):
    """`Decoder.start_many` with the bucketed prefill: the frames, lengths, sampler state and keys of `start` per
    slot (the batch engine's admission); a decoder without `many` starts one by one."""
    from higgs_rt.generate import Decoder
    from higgs_rt.params import SamplingParams
    from higgs_rt.prompt import Prompt

    prompts = [Prompt(*prompt(talker, text, audio, seed=70 + i)) for i, (text, audio) in
               enumerate([(40, 0), (50, 0), (20, 70), (33, 0)])]
    params = [SamplingParams(seed=i, temperature=0.5 + 0.1 * i) for i in range(4)]
    one, many = (Decoder(talker, batch=4, context=512, ignore_eos=True) for _ in range(2))
    for decoder in (one, many):
        decoder.prefill_fn = BucketedPrefill(talker, decoder.cache, graphs=False)
    starts = [(slot, p, q, slot == 2) for slot, (p, q) in zip((3, 0, 2, 1), zip(prompts, params))]
    want = [one.start(*s) for s in starts]
    got = many.start_many(starts)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (one.prefill_forwards, many.prefill_forwards) == (4, 3)  # 3 prompts of the 64 bucket: 2 forwards of 2
    assert torch.equal(many.cache.lengths, one.cache.lengths) and torch.equal(many.suppress_eos, one.suppress_eos)
    assert (many.cache.k - one.cache.k).abs().max() <= TOL
    for name in ("temperature", "top_k", "top_p", "done"):
        assert torch.equal(getattr(many.sampler, name), getattr(one.sampler, name)), name
    plain = Decoder(talker, batch=4, context=512)
    with pytest.raises(ValueError, match="ignore_eos needs a decoder built with ignore_eos=True"):
        plain.start_many(starts)


def test_admission_and_release_set_state_by_kernels_not_host_scalars(talker, monkeypatch):
    """`state[slot] = python_number` on a CUDA tensor copies the number from pageable memory, which waits for the
    stream (the decode loop then loses its step in flight): the admission (`start_many`: prefill groups, the
    sampler's reset with a RAS tail) and `release` set per-slot state with fills and queued copies only. Checked
    here on the CPU by the values reaching `Tensor.__setitem__`; tests/test_gpu.py checks it with the GPU's sync
    debug mode."""
    from higgs_rt.generate import Decoder
    from higgs_rt.params import SamplingParams
    from higgs_rt.prompt import Prompt

    decoder = Decoder(talker, batch=4, context=512, ignore_eos=True)
    decoder.prefill_fn = BucketedPrefill(talker, decoder.cache, graphs=False)
    prompts = [Prompt(*prompt(talker, text, audio, seed=text)) for text, audio in ((40, 0), (50, 0), (30, 20))]
    starts = [(slot, p, SamplingParams(seed=slot), slot == 1) for slot, p in enumerate(prompts)]
    scalars = []
    setitem = torch.Tensor.__setitem__

    def state() -> set[int]:  # the storages of the decoder's device-side state (host staging tensors are fine)
        prefill = decoder.prefill_fn
        owners = (decoder, decoder.sampler, decoder.cache, prefill, *prefill._buckets.values())
        return {t.untyped_storage().data_ptr() for o in owners for t in vars(o).values() if isinstance(t, torch.Tensor)}

    def spy(self, index, value):
        if not isinstance(value, torch.Tensor) and self.untyped_storage().data_ptr() in state():
            scalars.append((tuple(self.shape), index, value))
        return setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    decoder.start_many(starts)
    decoder.release(2)
    monkeypatch.undo()
    assert scalars == []
    assert decoder.cache.lengths.tolist() == [len(prompts[0]), len(prompts[1]), 0, 0]
    assert decoder.sampler.done.tolist() == [False, False, True, True] and decoder.suppress_eos[:2].tolist() == [False, True]
    assert decoder.sampler.temperature[0].item() == pytest.approx(SamplingParams().temperature)


@torch.no_grad()
def test_many_keeps_to_the_graph_cap(talker, monkeypatch):
    """Past `MAX_GRAPHS` (a graph per bucket) a bucket's prompts run the eager prefill; their keys and values are
    right either way."""
    import higgs_rt.prefill as prefill_module

    monkeypatch.setattr(prefill_module, "MAX_GRAPHS", 2)
    cache = talker.new_cache(6, 1024)
    prefill = BucketedPrefill(talker, cache, graphs=False)
    prompts = [prompt(talker, text, 0, seed=90 + i) for i, text in enumerate((40, 50, 60, 20, 25, 100))]
    prefill.many(cache, [(slot, ids, frames) for slot, (ids, frames) in enumerate(prompts)])
    assert set(prefill._buckets) == {(64, 0), (32, 0)}  # the first two buckets took both; 100 tokens ran eagerly
    for slot, (ids, frames) in enumerate(prompts):
        want = talker.new_cache(1, 1024)
        talker.prefill(want, 0, ids, frames)
        t = ids.shape[0]
        assert int(cache.lengths[slot]) == t
        assert (cache.k[:, slot, :, :t] - want.k[:, 0, :, :t]).abs().max() <= TOL, slot


@torch.no_grad()
def test_a_prompt_gets_the_same_bits_alone_and_in_any_admission(talker):
    """Every forward of a bucket has `group_of` rows whatever arrived (the first prompt repeated to fill it), so a
    prompt's keys and values are bit-identical alone and beside 1 to 8 others (tests/test_gpu.py checks the same in
    bf16 with the CUDA kernels, where cuBLAS picks kernels by shape)."""
    cache = talker.new_cache(10, 1024)
    prefill = BucketedPrefill(talker, cache, graphs=False)
    prompts = [prompt(talker, text, 0, seed=110 + i) for i, text in enumerate((40, 46, 50, 61, 55, 58, 44, 49, 60))]
    prefill(cache, 9, *prompts[0])
    t = prompts[0][0].shape[0]
    alone = cache.k[:, 9, :, :t].clone(), cache.v[:, 9, :, :t].clone()
    for others in (1, 3, 8):
        cache.k.zero_(), cache.v.zero_()
        prefill.many(cache, [(9 - j, *prompts[j]) for j in range(others + 1)][::-1])
        assert torch.equal(cache.k[:, 9, :, :t], alone[0]) and torch.equal(cache.v[:, 9, :, :t], alone[1]), others
        assert int(cache.lengths[9]) == t and int(cache.lengths[9 - others]) == prompts[others][0].shape[0]
    assert {b.ids.shape for b in prefill._buckets.values()} == {(group_of((64, 0)), 64)}  # one graph's shape
