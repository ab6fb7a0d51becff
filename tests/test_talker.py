"""Talker parity with transformers' HiggsAudioV2ForConditionalGeneration on random tiny checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from higgs_rt.generate import Decoder, generate
from higgs_rt.prompt import PromptBuilder
from higgs_rt.sampling import SamplingParams
from higgs_rt.talker import Talker

from conftest import TINY_TALKERS

TOL = 1e-5
GREEDY = SamplingParams(temperature=0, ras_window=0)
TEXT = "The sun rises in the east and sets in the west."


@pytest.fixture(scope="module", params=TINY_TALKERS)
def setup(request, talker_dirs):
    hf_dir, boson_dir, oracle = talker_dirs[request.param]
    model = Talker.from_pretrained(hf_dir)
    builder = PromptBuilder(hf_dir, model.cfg.audio_out_token_id)
    return model, oracle, builder.tts(TEXT), boson_dir, builder


def random_frames(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.num_codes, (n, cfg.num_codebooks), generator=g)


@torch.no_grad()
def test_prefill_logits_match_oracle(setup):
    model, oracle, prompt, _, _ = setup
    want = oracle(input_ids=prompt.ids[None]).logits[0, -1].view(model.cfg.num_codebooks, -1)
    got = model.prefill(model.new_cache(1, 256), 0, prompt.ids)
    assert got.shape == (model.cfg.num_codebooks, model.cfg.codebook_vocab)
    assert (got - want).abs().max() <= TOL


@torch.no_grad()
def test_teacher_forced_steps_match_oracle(setup):
    """50 decode steps fed the same frames: every step's logits within 1e-5."""
    model, oracle, prompt, _, _ = setup
    frames = random_frames(model.cfg, 50, seed=1)
    frames[0] = model.cfg.stream_bos_id
    out = oracle(input_ids=prompt.ids[None], use_cache=True)
    past = out.past_key_values
    cache = model.new_cache(1, 256)
    model.prefill(cache, 0, prompt.ids)
    worst = 0.0
    for t in range(frames.shape[0]):
        out = oracle(audio_input_ids=frames[t][None, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        got = model.step(cache, frames[t][None])[0]
        worst = max(worst, (got - out.logits[0, -1].view_as(got)).abs().max().item())
    assert int(cache.lengths[0]) == len(prompt) + 50
    assert worst <= TOL


@torch.no_grad()
def test_mixed_text_audio_prefill_matches_oracle(setup):
    """A clone-style prompt: audio positions take summed frame embeddings and run the audio FFN."""
    model, oracle, _, _, builder = setup
    ref = random_frames(model.cfg, 13, seed=2)
    prompt = builder.clone(TEXT, "A reference transcript.", ref)
    n_audio = int((prompt.ids == model.cfg.audio_out_token_id).sum())
    assert n_audio == 13
    want = oracle(input_ids=prompt.ids[None], audio_input_ids=ref[None]).logits[0, -1]
    got = model.prefill(model.new_cache(1, 256), 0, prompt.ids, ref)
    assert (got - want.view_as(got)).abs().max() <= TOL


@torch.no_grad()
def test_boson_layout_gives_identical_logits(setup):
    """The layouts load to bitwise-equal weights; the logits agree to a few float32 ulps, not bitwise, because
    the memory-mapped tensors sit at other alignments (16 vs 24 bytes mod 64 here) and the CPU's BLAS takes
    another SIMD path for another alignment (0.75 ulp apart on one machine, equal on another)."""
    model, _, prompt, boson_dir, _ = setup
    boson = Talker.from_pretrained(boson_dir)
    assert boson.cfg.layout == "boson" and model.cfg.layout == "transformers"
    mine, theirs = model.state_dict(), boson.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a = model.prefill(model.new_cache(1, 64), 0, prompt.ids)
    b = boson.prefill(boson.new_cache(1, 64), 0, prompt.ids)
    ulp = torch.finfo(torch.float32).eps * a.abs().max().item()
    assert (a - b).abs().max().item() <= 8 * ulp


@torch.no_grad()
def test_greedy_generation_equals_generate(setup):
    model, oracle, prompt, _, _ = setup
    want = oracle.generate(input_ids=prompt.ids[None], max_new_tokens=60, do_sample=False)[0]
    got = generate(Decoder(model, context=256), prompt, GREEDY, max_frames=60)
    assert got.frames.shape == want.shape
    assert torch.equal(got.frames, want)
    assert got.finished == bool((want[-1] == model.cfg.stream_eos_id).all())


def test_prefill_rejects_mismatched_audio(setup):
    model, _, prompt, _, _ = setup
    with pytest.raises(ValueError, match="0 audio positions but 3 audio frames"):
        model.prefill(model.new_cache(1, 64), 0, prompt.ids, random_frames(model.cfg, 3, 0))
    with pytest.raises(ValueError, match="the cache holds 1 to 8"):
        model.prefill(model.new_cache(1, 8), 0, prompt.ids)


@torch.no_grad()
def test_batched_slots_match_single_slot(setup):
    """Slots advance independently at their own positions: slot 1 of a batch equals a batch of one."""
    model, _, prompt, _, _ = setup
    frames = random_frames(model.cfg, 6, seed=3)
    single = model.new_cache(1, 128)
    model.prefill(single, 0, prompt.ids)
    batch = model.new_cache(3, 128)
    model.prefill(batch, 1, prompt.ids)
    model.prefill(batch, 2, prompt.ids[:-5])  # another slot at another position
    for t in range(frames.shape[0]):
        want = model.step(single, frames[t][None])[0]
        got = model.step(batch, frames[t][None].expand(3, -1).contiguous())[1]
        assert (got - want).abs().max() <= TOL
    assert batch.lengths.tolist()[1:] == [len(prompt) + 6, len(prompt) + 1]


@pytest.mark.parametrize("available", [64 * 10**9, None])
def test_a_kv_cache_the_device_cannot_hold_is_one_clear_error(setup, monkeypatch, available):
    """Past any address space (2^48 bytes and more): refused with what to lower, against the available memory or,
    where that is not known, by the allocator."""
    import higgs_rt.talker as talker
    from higgs_rt.talker import KVCache, KVCacheTooLarge

    monkeypatch.setattr(talker, "available_memory", lambda device: available)
    limit = "90% of the 64.00 GB available on cpu" if available else "cpu can allocate"
    cfg = setup[0].cfg
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * 131072 * cfg.head_dim * 4  # k and v, fp32
    batch = (1 << 48) // per_slot + 1
    with pytest.raises(KVCacheTooLarge, match=f"the KV cache of {batch} slot\\(s\\) x 131072 positions needs "
                                              f"[0-9.]+ GB, more than {limit}: lower the context"):
        KVCache(cfg, batch, 131072, torch.float32, "cpu")
    for batch in (2**62, 2**70):  # past torch's int64 sizes: its overflow error (C++ frames and all), not this
        with pytest.raises(KVCacheTooLarge, match=f"the KV cache of {batch} slot\\(s\\) x 4096 positions needs over "
                                                  f"9223372037 GB, more than {limit}: lower the context"):
            KVCache(cfg, batch, 4096, torch.float32, "cpu")
    with pytest.raises(KVCacheTooLarge, match=r"lower the context \(--context\) or the slots \(--slots\)$"):
        KVCache(cfg, 2**62, 4096, torch.float32, "cpu")
    with pytest.raises(KVCacheTooLarge, match=r"^the KV cache of 1 slot\(s\) .* lower the context \(--context\)$"):
        KVCache(dataclasses.replace(cfg, num_kv_heads=1 << 40), 1, 4096, torch.float32, "cpu")  # one slot: no --slots


def test_a_kv_cache_past_the_available_memory_is_refused_before_it_is_allocated(setup, monkeypatch):
    """`export --batch 100000 --context 512` on the CPU was OOM-killed (22 GB) instead of refused: Linux let the
    allocation through and zero-filling it took the memory. The cache is checked against the memory available
    (a tenth kept for the rest) before anything is allocated; nothing here allocates more than a few kB."""
    import higgs_rt.talker as talker
    from higgs_rt.talker import KVCache, KVCacheTooLarge

    cfg = setup[0].cfg
    needs = KVCache.nbytes(cfg, 100000, 512, torch.float32)
    assert needs > 5 * 10**9  # the allocator would have granted it: only the check stands in the way
    monkeypatch.setattr(talker, "available_memory", lambda device: 8 * 10**9)
    with pytest.raises(KVCacheTooLarge) as caught:
        KVCache(cfg, 100000, 512, torch.float32, "cpu")
    assert str(caught.value) == (f"the KV cache of 100000 slot(s) x 512 positions needs {needs / 1e9:.2f} GB, more "
                                 "than 90% of the 8.00 GB available on cpu: lower the context (--context) or the "
                                 "slots (--slots)")
    small = KVCache.nbytes(cfg, 2, 64, torch.float32)
    for available, fits in ((small, False), (int(small / 0.9) + 1, True)):  # the headroom: a tenth stays free
        monkeypatch.setattr(talker, "available_memory", lambda device: available)
        if fits:
            assert KVCache(cfg, 2, 64, torch.float32, "cpu").k.shape[1] == 2
        else:
            with pytest.raises(KVCacheTooLarge, match="B available on cpu: lower"):
                KVCache(cfg, 2, 64, torch.float32, "cpu")


def test_the_available_cpu_memory_is_memavailable_or_a_containers_cgroup_limit(monkeypatch):
    import higgs_rt.talker as talker

    files = {"/proc/meminfo": "MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n"}
    monkeypatch.setattr(talker, "_read", lambda path: files.get(path, ""))
    cpu = torch.device("cpu")
    assert talker.available_memory(cpu) == 20000000 * 1024
    files.update({"/sys/fs/cgroup/memory.max": "8000000000\n", "/sys/fs/cgroup/memory.current": "3000000000\n",
                  "/sys/fs/cgroup/memory.stat": "anon 1\ninactive_file 1000000000\nactive_file 5\n"})
    assert talker.available_memory(cpu) == 6 * 10**9  # the limit, less what is used, page cache not counted
    files["/sys/fs/cgroup/memory.max"] = "max\n"  # no limit
    assert talker.available_memory(cpu) == 20000000 * 1024
    files.clear()
    assert talker.available_memory(cpu) is None  # not Linux: the allocator decides
    assert talker.available_memory(torch.device("meta")) is None


def test_speak_and_a_servers_slots_are_checked_the_same_way(random_model, tmp_path, monkeypatch, capsys):
    """Every KV cache is made by KVCache: speak's (its --context) and the batch engine's (its --slots)."""
    import higgs_rt.talker as talker
    from higgs_rt.cli import main
    from higgs_rt.model import Model
    from higgs_rt.talker import KVCacheTooLarge

    monkeypatch.setattr(talker, "available_memory", lambda device: 10**4)
    assert main(["speak", "Hi.", "--model", str(random_model), "--context", "131072",
                 "--out", str(tmp_path / "hi.wav")]) == 1
    err = capsys.readouterr().err
    assert err == ("higgs-rt: error: the KV cache of 1 slot(s) x 131072 positions needs 67.1 MB, more than 90% of the "
                   "10.0 kB available on cpu: lower the context (--context)\n")
    with pytest.raises(KVCacheTooLarge, match=r"^the KV cache of 8 slot\(s\) .* or the slots \(--slots\)$"):
        Model(random_model, device="cpu").decoder(slots=8)


@pytest.mark.parametrize("context", [0, 15, 131073, 2.5, True, "4096"])
def test_a_context_out_of_range_is_refused_before_loading(context):
    from higgs_rt.model import Model

    with pytest.raises(ValueError, match="context must be an integer in \\[16, 131072\\]"):
        Model("/nonexistent/model", context=context)
