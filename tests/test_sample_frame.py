"""ops.sample_frame (the fused sampler, CUDA) against its reference, FrameSampler's torch code: the same codes
and the same state for the same fp32 logits and seeds, frame after frame, for every sampling setting; and its
argument checks, which run on the CPU before the op is called."""

from __future__ import annotations

import copy

import pytest
import torch

from higgs_rt import ops
from higgs_rt.sampling import FrameSampler, SamplingParams

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.HAS_CUDA_KERNELS),
                          reason="needs a CUDA GPU and a CUDA build of higgs-rt")

Q, K = 8, 1024
STATE = ("seeds", "frame", "eos_start", "done", "history", "temperature", "top_k", "top_p", "greedy", "ras_on",
         "ras_max")
PARAMS = [SamplingParams(seed=1), SamplingParams(seed=2, temperature=0.7, top_k=5, top_p=0.5),
          SamplingParams(seed=3, temperature=1.3, top_k=0, top_p=0.9), SamplingParams(seed=4, top_k=1026, top_p=1.0),
          SamplingParams(seed=5, temperature=0.0), SamplingParams(seed=6, ras_window=0),
          SamplingParams(seed=7, ras_max_repeat=1), SamplingParams(seed=2**40 + 9, top_k=1)]


def top_p_tie(logits, sampler, b, q, tol=1e-6):
    """The documented tie: a cumulative probability of the filtered scores within tol of 1 - top_p (float64)."""
    from higgs_rt.sampling import filter_logits

    scores = logits[b:b + 1].double()
    kept = filter_logits(scores, sampler.temperature[b:b + 1].double(), sampler.top_k[b:b + 1],
                         torch.ones(1, dtype=torch.float64, device=logits.device))[0, q]
    cum = kept.sort().values.softmax(-1).cumsum(-1)
    return bool(((cum - (1 - sampler.top_p[b].double())).abs() < tol).any())


def run(batch, frames, logit_scale, ramp_out_at=None, seed=0, bf16=False):
    ref = FrameSampler(batch, Q, K, "cuda", 7)
    for slot in range(batch):
        if slot != batch - 1 or batch == 1:  # the last slot stays idle (done) when there are several
            prompt = torch.randint(0, K, (12, Q), device="cuda")
            ref.reset(slot, PARAMS[slot % len(PARAMS)], prompt)
    g = torch.Generator(device="cuda").manual_seed(seed)
    ref_len = torch.randint(10, 100, (batch,), device="cuda")
    fused, fused_len = copy.deepcopy(ref), ref_len.clone()
    mismatches = 0
    for t in range(frames):
        logits = torch.randn(batch, Q, K + 2, generator=g, device="cuda") * logit_scale
        if bf16:
            logits = logits.bfloat16().float()
        if ramp_out_at is not None and t >= ramp_out_at:
            logits[:, :, K + 1] += 50  # EOS everywhere: exercises the ramp-out and done
        with ops.references():
            want = ref.step(logits, ref_len)
        got = fused.step(logits, fused_len)
        bad = (got != want).nonzero().tolist()
        for b, q in bad:
            assert top_p_tie(logits, ref, b, q), f"frame {t}, slot {b}, codebook {q}: {got[b, q]} != {want[b, q]}"
        mismatches += len(bad)
        if bad:  # a documented tie: carry on from the reference's state
            fused = copy.deepcopy(ref)
            fused_len.copy_(ref_len)
            continue
        for name in STATE:
            assert torch.equal(getattr(fused, name), getattr(ref, name)), (t, name)
        assert torch.equal(fused_len, ref_len), t
    return ref, mismatches


@cuda
@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_same_codes_and_state_as_the_reference(batch):
    ref, mismatches = run(batch, frames=40, logit_scale=3.0, seed=batch)
    assert mismatches <= 1
    assert (ref.frame > 30).all()


@cuda
def test_ramp_out_and_done_slots():
    ref, _ = run(8, frames=30, logit_scale=2.0, ramp_out_at=12, seed=11)
    assert ref.done.all() and (ref.eos_start[:-1] >= 12).all()  # the last slot idled (done) from the start


@cuda
def test_flat_logits_with_many_ties_in_value():
    """bf16-rounded logits have many equal values: ties in value go to the lowest index, as torch.argmax."""
    run(4, frames=20, logit_scale=0.05, seed=3, bf16=True)


# --------------------------------------------------------------------------- argument checks (CPU)


def frame_args(b=2, q=3, v=8, w=4):
    """Valid arguments but for the device: B slots, Q codebooks, V entries each, a RAS ring of W frames."""
    s = FrameSampler(b, q, v - 2, "cpu", w)
    return dict(logits=torch.zeros(b, q, v), seeds=s.seeds, frame=s.frame, eos_start=s.eos_start, done=s.done,
                history=s.history, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=s.greedy,
                ras_on=s.ras_on, ras_max=s.ras_max, lengths=torch.zeros(b, dtype=torch.int64), window=w)


@pytest.mark.parametrize("name,value", [
    ("logits", torch.zeros(2, 3, 8, dtype=torch.float64)),
    ("logits", torch.zeros(2, 24)),
    ("logits", torch.zeros(2, 3, 2049)),  # the kernel sorts at most 2048 entries
    ("logits", torch.zeros(2, 3, 2)),  # BOS and EOS at least
    ("seeds", torch.zeros(2, dtype=torch.int32)),
    ("frame", torch.zeros(1, dtype=torch.int64)),
    ("done", torch.zeros(2, dtype=torch.int64)),
    ("temperature", torch.ones(2, dtype=torch.float64)),
    ("top_p", torch.ones(2, device="meta")),
    ("ras_max", torch.zeros(2, 1, dtype=torch.int64)),
    ("history", torch.zeros(2, 4, 4, dtype=torch.int64)),
    ("history", torch.zeros(2, 0, 3, dtype=torch.int64)),
    ("window", 5),
    ("window", -1),
    ("window", 2.0),
    # written in place: a strided view is refused, not copied
    ("lengths", torch.zeros(4, dtype=torch.int64)[::2]),
    ("eos_start", torch.zeros(2, 2, dtype=torch.int64)[:, 0]),
    ("history", torch.zeros(2, 3, 4, dtype=torch.int64).transpose(1, 2)),
])
def test_bad_arguments(name, value):
    args = frame_args()
    args[name] = value
    with pytest.raises(ValueError, match=rf"^sample_frame: {name}\b"):
        ops.sample_frame(**args)


def test_cpu_tensors_are_refused_in_one_line():
    with pytest.raises(NotImplementedError, match=r"^sample_frame: CUDA only .* got logits on cpu") as error:
        ops.sample_frame(**frame_args())
    assert "\n" not in str(error.value)
