"""The prompt forward's row-wise ops (higgs_rt.ops.rowwise: RMSNorm with the residual add and a weight per row,
RoPE with the q/k/v split, SwiGLU) against their torch references, which are the Talker's layer as transformers
rounds it; and the Talker's prompt forward with the kernels against the same forward on the references. Checks
and errors on the CPU; the kernels on CUDA (RoPE and SwiGLU: torch's bits; RMSNorm: the sum of squares in another
order, so a rounding apart here and there)."""

from __future__ import annotations

import pytest
import torch

from higgs_rt import ops
from higgs_rt.ops import HAS_CUDA_KERNELS

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_CUDA_KERNELS),
                          reason="needs a CUDA GPU and a CUDA build of higgs-rt")


def rand(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def norm_inputs(dtype, device, n=3, t=37, h=3072):
    x = rand(n, t, h, dtype=dtype, device=device, seed=1, scale=3)
    res = rand(n, t, h, dtype=dtype, device=device, seed=2)
    w, aw = rand(h, dtype=dtype, device=device, seed=3), rand(h, dtype=dtype, device=device, seed=4)
    rows = torch.rand(n, t, generator=torch.Generator().manual_seed(5)) > 0.5
    return x, res, w, aw, rows.to(device)


def ulp_close(got, want):
    """The sum of squares in another order: its fp32 rounding (~1e-6 relative over 3072 terms) moves a bf16 or fp16
    result by a unit in its last place where it flips a rounding, twice at most (the normed value, then the product
    with the weight); an fp32 result by a few units (measured on the H200: 70% of fp32 values equal, all within
    1e-5)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    rtol = 1e-5 if want.dtype == torch.float32 else 2 * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)
    if want.dtype != torch.float32:  # in fp32 a row's scale differs in its last bits, so most of the row does
        assert (got == want).float().mean() > 0.9


def test_the_references_are_the_talkers_layer_on_the_cpu():
    """On the CPU the ops are their references; the per-row weight is the where of two norms, the residual form
    the add then the norm, and RoPE + split the rotate-half convention of the decode step's `rotate`."""
    x, res, w, aw, rows = norm_inputs(torch.float32, "cpu", t=5, h=64)
    want = torch.where(rows[..., None], ops.rms_norm(x, aw, 1e-5), ops.rms_norm(x, w, 1e-5))
    assert torch.equal(ops.rms_norm(x, w, 1e-5, aw, rows), want)
    s, normed = ops.add_rms_norm(x, res, w, 1e-5, aw, rows)
    assert torch.equal(s, x + res) and torch.equal(normed, ops.rms_norm(x + res, w, 1e-5, aw, rows))
    assert not torch.equal(normed, ops.rms_norm(x + res, w, 1e-5))  # the audio rows took their own weight
    pos, inv = torch.tensor([7, 300]), torch.rand(8)
    angles = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)[:, None]  # [B, T = 1, D]
    qkv = rand(2, 1, (4 + 2 * 2) * 16, seed=6)
    q, k, v = ops.rope_qkv(qkv, angles.cos(), angles.sin(), 4, 2)
    assert q.shape == (2, 4, 1, 16) and k.shape == v.shape == (2, 2, 1, 16)
    heads = qkv.view(2, 8, 16)
    torch.testing.assert_close(q[:, :, 0], ops.rotate(heads[:, :4], pos, inv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[:, :, 0], ops.rotate(heads[:, 4:6], pos, inv), rtol=1e-5, atol=1e-5)
    assert torch.equal(v[:, :, 0], heads[:, 6:])
    gu = rand(3, 10, seed=7)
    assert torch.equal(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :5]) * gu[:, 5:])


def test_bad_arguments_are_named():
    x, res, w, aw, rows = norm_inputs(torch.float32, "cpu", t=5, h=64)
    with pytest.raises(ValueError, match=r"rms_norm: x must be a float tensor \[..., H\], got torch.int64"):
        ops.rms_norm(x.long(), w, 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have 64 entries \(x's last dim\), got shape \(63,\)"):
        ops.rms_norm(x, w[:63], 1e-5)
    with pytest.raises(ValueError, match="rms_norm: weight must be a torch.Tensor, got NoneType"):
        ops.rms_norm(x, None, 1e-5)
    with pytest.raises(ValueError, match="rms_norm: weight must be float32, got bfloat16"):
        ops.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="rms_norm: audio_weight and audio_rows come together"):
        ops.rms_norm(x, w, 1e-5, aw)
    with pytest.raises(ValueError, match=r"rms_norm: audio_rows must be \[3, 5\] \(x's rows\), got \(3, 4\)"):
        ops.rms_norm(x, w, 1e-5, aw, rows[:, :4])
    with pytest.raises(ValueError, match="rms_norm: eps must be >= 0, got -1"):
        ops.rms_norm(x, w, -1)
    with pytest.raises(ValueError, match=r"add_rms_norm: residual must be shaped as x \(3, 5, 64\), got \(3, 4, 64\)"):
        ops.add_rms_norm(x, res[:, :4], w, 1e-5)
    cos = torch.ones(1, 5, 16)
    with pytest.raises(ValueError, match=r"rope_qkv: qkv \(1, 5, 120\) is not 4 \+ 2 x 2 heads of cos's 16"):
        ops.rope_qkv(torch.ones(1, 5, 120), cos, cos, 4, 2)
    with pytest.raises(ValueError, match=r"rope_qkv: cos and sin must be \[1 or 1, 5, 16\], got \(1, 4, 16\)"):
        ops.rope_qkv(torch.ones(1, 5, 128), cos[:, :4], cos[:, :4], 4, 2)
    with pytest.raises(ValueError, match="rope_qkv: cos must be float32, got bfloat16"):
        ops.rope_qkv(torch.ones(1, 5, 128), cos.bfloat16(), cos, 4, 2)
    with pytest.raises(ValueError,
                       match=r"silu_mul: gate_up must be a float tensor \[..., 2I\], got torch.float32 \(2, 7\)"):
        ops.silu_mul(torch.ones(2, 7))


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [3072, 100, 20000])  # 16-byte vectors in registers; not whole vectors; too wide for them
def test_rms_norm_kernel(dtype, h):
    x, res, w, aw, rows = norm_inputs(dtype, "cuda", h=h)
    with ops.references():
        plain, mixed = ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5, aw, rows)
        want_sum, want = ops.add_rms_norm(x, res, w, 1e-5, aw, rows)
    ulp_close(ops.rms_norm(x, w, 1e-5), plain)
    ulp_close(ops.rms_norm(x, w, 1e-5, aw, rows), mixed)
    got_sum, got = ops.add_rms_norm(x, res, w, 1e-5, aw, rows)
    assert torch.equal(got_sum, want_sum)
    ulp_close(got, want)
    one = ops.rms_norm(x[:1, :1], w, 1e-5)  # a row's result does not depend on the others
    assert torch.equal(one[0, 0], ops.rms_norm(x, w, 1e-5)[0, 0])


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_angles", [True, False])
@pytest.mark.parametrize("d", [128, 4])  # whole 16-byte vectors per half head; not
def test_rope_qkv_kernel_gives_torchs_bits(dtype, shared_angles, d):
    b, t, hq, hkv = 3, 29, 24, 8
    qkv = rand(b, t, (hq + 2 * hkv) * d, dtype=dtype, device="cuda", seed=8, scale=2)
    starts = 0 if shared_angles else torch.tensor([[0], [50], [900]], device="cuda")
    pos = torch.arange(t, device="cuda")[None] + starts
    freqs = pos[..., None].float() * torch.rand(d // 2, device="cuda")
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = ops.rope_qkv(qkv, cos, sin, hq, hkv)
    with ops.references():
        want = ops.rope_qkv(qkv, cos, sin, hq, hkv)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape and torch.equal(g, w)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8192, 5])  # whole 16-byte vectors; not
def test_silu_mul_kernel_gives_torchs_bits(dtype, width):
    gu = rand(37, 2 * width, dtype=dtype, device="cuda", seed=9, scale=4)
    got = ops.silu_mul(gu)
    with ops.references():
        want = ops.silu_mul(gu)
    assert got.shape == (37, width) and torch.equal(got, want)


@cuda
@pytest.mark.parametrize("audio", [0, 5, 12])
def test_prompt_forward_with_the_kernels(audio):
    """The Talker's prompt forward (text only, mixed, all audio) on the kernels against the references, bf16."""
    from higgs_rt.config import TalkerConfig
    from higgs_rt.fixtures.talker import random_state
    from higgs_rt.talker import Talker
    from higgs_rt.weights import map_weights

    hf, state = random_state("small", "cuda", torch.bfloat16, seed=4)
    cfg = TalkerConfig.from_dict(hf)
    talker = Talker.from_weights(cfg, map_weights(state, cfg, torch.bfloat16, "cuda"))
    g = torch.Generator().manual_seed(audio)
    ids = torch.randint(0, 1000, (12,), generator=g)
    ids[:audio] = cfg.audio_token_ids[0]
    frames = torch.randint(0, cfg.codebook_vocab - 2, (audio, cfg.num_codebooks), generator=g) if audio else None
    ids, frames = talker.check_prompt(ids, frames, 64)
    keys = {}
    got = talker.prompt_forward(ids, frames, lambda i, k, v: keys.setdefault(("got", i), k))
    with ops.references():
        want = talker.prompt_forward(ids, frames, lambda i, k, v: keys.setdefault(("want", i), k))
    assert got.shape == want.shape == (cfg.num_codebooks, cfg.codebook_vocab)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    for i in range(cfg.num_layers):
        torch.testing.assert_close(keys["got", i], keys["want", i], rtol=0.02, atol=0.02)
