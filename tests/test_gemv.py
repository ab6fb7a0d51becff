"""The decode GEMV family (ops.gemv, gemv_residual, norm_gemv_silu, norm_gemv_logits, norm_qkv_rope): torch
references against literal definitions, validation, fake / compile paths, and (on a GPU) the CUDA kernels
against the references at the Talker's real shapes, odd shapes, batch sizes 1 to 64, batch invariance, and
CUDA-graph replay."""

import math

import pytest
import torch
import torch.nn.functional as F

from higgs_rt import ops
from higgs_rt.cuda_graph import capture_graph

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.HAS_CUDA_KERNELS), reason="needs a CUDA GPU and a CUDA build of higgs-rt"
)
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
HALF = [torch.bfloat16, torch.float16]

# Talker decode shapes, K -> N: fused qkv, o, fused gate/up, down, audio head.
REAL_GEMV = [(3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072), (3072, 8208)]
BATCHES = [1, 2, 5, 8, 9, 16, 17, 33, 64]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
EPS = 1e-5


def close(actual, expected, dtype, scale=1.0):
    """actual against an fp32/fp64 reference: one rounding to dtype plus accumulation noise (relative to scale)."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def linear_inputs(b, k, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)  # outputs ~ N(0, 1)
    return x.to(device, dtype), w.to(device, dtype)


def norm_weight(k, dtype, device, seed=1):
    return (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


def normed64(x, g):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


def rope64(x, pos, inv_freq):
    """Rotate-half RoPE, literally: out[d] = x[d] cos - x[d + D/2] sin, out[d + D/2] = x[d + D/2] cos + x[d] sin."""
    half = x.shape[-1] // 2
    angle = pos.double()[:, None, None] * inv_freq.double()
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()), -1)


def qkv_inputs(b, hq, hkv, d, k, s, dtype, device, seed=0):
    x, w = linear_inputs(b, k, (hq + 2 * hkv) * d, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    caches = [torch.randn(2, b, hkv, s, d, generator=g).to(device, dtype) for _ in range(2)]
    lengths = torch.randint(0, s + 3, (b,), generator=g).to(device)  # some past the end: clamped to S - 1
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2) / d)).float().to(device)
    return x, norm_weight(k, dtype, device), w, inv_freq, lengths, caches[0], caches[1]


def qkv64(x, g, w, inv_freq, lengths, k_cache, v_cache, layer):
    """What norm_qkv_rope must return and write, in fp64: (q, expected caches)."""
    d, hkv, s = k_cache.shape[4], k_cache.shape[2], k_cache.shape[3]
    hq = w.shape[0] // d - 2 * hkv
    qkv = (normed64(x, g) @ w.double().t()).view(x.shape[0], -1, d)
    pos = lengths.clamp(0, s - 1)
    kc, vc = k_cache.clone(), v_cache.clone()
    rows = torch.arange(x.shape[0], device=x.device)
    kc[layer, rows, :, pos] = rope64(qkv[:, hq:hq + hkv], pos, inv_freq).to(kc.dtype)
    vc[layer, rows, :, pos] = qkv[:, hq + hkv:].to(vc.dtype)
    return rope64(qkv[:, :hq], pos, inv_freq), kc, vc


# --------------------------------------------------------------------------- references (CPU)


def test_gemv_ref_matches_fp64():
    x, w = linear_inputs(3, 64, 20, torch.bfloat16, "cpu")
    close(ops.gemv_ref(x, w), x.double() @ w.double().t(), torch.bfloat16)


def test_gemv_residual_ref_matches_fp64():
    x, w = linear_inputs(3, 64, 20, torch.bfloat16, "cpu")
    r = torch.randn(3, 20).bfloat16()
    close(ops.gemv_residual_ref(x, w, r), r.double() + x.double() @ w.double().t(), torch.bfloat16)


def test_norm_gemv_silu_ref_matches_the_gated_mlp():
    x, w = linear_inputs(4, 64, 2 * 24, torch.float32, "cpu")
    g = norm_weight(64, torch.float32, "cpu")
    h = normed64(x, g) @ w.double().t()
    close(ops.norm_gemv_silu_ref(x, g, EPS, w), F.silu(h[:, :24]) * h[:, 24:], torch.float32)


def test_norm_gemv_logits_ref_is_fp32_rounded_to_the_dtype():
    x, w = linear_inputs(2, 64, 30, torch.bfloat16, "cpu")
    g = norm_weight(64, torch.bfloat16, "cpu")
    y = ops.norm_gemv_logits_ref(x, g, EPS, w)
    assert y.dtype == torch.float32 and torch.equal(y, y.bfloat16().float())
    close(y, normed64(x, g) @ w.double().t(), torch.bfloat16)


def test_norm_qkv_rope_ref_matches_the_literal_definition():
    args = qkv_inputs(3, 4, 2, 16, 64, 10, torch.float32, "cpu")
    want_q, want_k, want_v = qkv64(*args, layer=1)
    x, g, w, inv_freq, lengths, kc, vc = args
    q = ops.norm_qkv_rope_ref(x, g, EPS, w, inv_freq, lengths, kc, vc, layer=1)
    close(q, want_q, torch.float32)
    close(args[-2], want_k, torch.float32)
    close(args[-1], want_v, torch.float32)


def test_rope_agrees_with_the_talkers_prefill_rope():
    from higgs_rt.ops import rope

    x = torch.randn(2, 3, 1, 16)
    pos = torch.tensor([5, 900])
    inv = torch.rand(8)
    angles = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)[:, None, None]
    want = rope(x, angles.cos(), angles.sin())
    torch.testing.assert_close(ops.rotate(x[:, :, 0], pos, inv), want[:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
def test_cpu_runs_the_references(dtype):
    x, w = linear_inputs(4, 40, 10, dtype, "cpu")
    g = norm_weight(40, dtype, "cpu")
    r = torch.randn(4, 10).to(dtype)
    assert torch.equal(ops.gemv(x, w), ops.gemv_ref(x, w))
    assert torch.equal(ops.gemv_residual(x, w, r), ops.gemv_residual_ref(x, w, r))
    assert torch.equal(ops.norm_gemv_silu(x, g, EPS, w), ops.norm_gemv_silu_ref(x, g, EPS, w))
    assert torch.equal(ops.norm_gemv_logits(x, g, EPS, w), ops.norm_gemv_logits_ref(x, g, EPS, w))


def ahead_views(w):
    """The `ahead` hint's two forms: the first rows of a weight, and the first rows of each of its stacked halves."""
    return [w[:3], w.view(2, w.shape[0] // 2, w.shape[1])[:, :2]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [1, 8, 17])
def test_ahead_is_only_a_hint(device, b):
    """gemv_residual and norm_gemv_logits give the same bits whatever later weights they warm in L2."""
    x, w = linear_inputs(b, 256, 64, torch.bfloat16, device)
    g = norm_weight(256, torch.bfloat16, device)
    r = torch.randn(b, 64).to(device, torch.bfloat16)
    _, later = linear_inputs(1, 256, 128, torch.bfloat16, device, seed=5)
    plain = ops.gemv_residual(x, w, r), ops.norm_gemv_logits(x, g, EPS, w)
    for ahead in ahead_views(later):
        assert torch.equal(ops.gemv_residual(x, w, r, ahead=ahead), plain[0])
        assert torch.equal(ops.norm_gemv_logits(x, g, EPS, w, ahead=ahead), plain[1])


# --------------------------------------------------------------------------- validation


def args_of(op):
    x, w = linear_inputs(2, 16, 4, torch.bfloat16, "cpu")
    g = norm_weight(16, torch.bfloat16, "cpu")
    return {"gemv": (x, w), "gemv_residual": (x, w, torch.zeros(2, 4).bfloat16()),
            "norm_gemv_silu": (x, g, EPS, w), "norm_gemv_logits": (x, g, EPS, w)}[op]


@pytest.mark.parametrize("op,change,name", [
    ("gemv", lambda a: (a[0].long(), a[1]), "x"),
    ("gemv", lambda a: (a[0][0], a[1]), "x"),
    ("gemv", lambda a: (a[0][:0], a[1]), "x"),
    ("gemv", lambda a: (a[0].repeat(33, 1), a[1]), "x"),  # 66 rows > 64
    ("gemv", lambda a: (a[0], a[1].half()), "w"),
    ("gemv", lambda a: (a[0], a[1][:, :8]), "w"),
    ("gemv", lambda a: (a[0], a[1][0]), "w"),
    ("gemv", lambda a: (a[0], a[1].to("meta")), "w"),
    ("gemv", lambda a: (a[0], "w"), "w"),
    ("gemv_residual", lambda a: (a[0], a[1], a[2][:1]), "residual"),
    ("gemv_residual", lambda a: (a[0], a[1], a[2].float()), "residual"),
    ("norm_gemv_silu", lambda a: (a[0], a[1][:8], a[2], a[3]), "norm_weight"),
    ("norm_gemv_silu", lambda a: (a[0], a[1], a[2], a[3][:3]), "w"),  # gate/up need an even row count
    ("norm_gemv_silu", lambda a: (a[0], a[1], -1.0, a[3]), "eps"),
    ("norm_gemv_logits", lambda a: (a[0], a[1].float(), a[2], a[3]), "norm_weight"),
])
def test_bad_arguments(op, change, name):
    with pytest.raises(ValueError, match=rf"^{op}: {name}\b"):
        getattr(ops, op)(*change(args_of(op)))


BAD_AHEAD = [
    (lambda w: w.t(), r"each run of ahead's rows must be contiguous, got shape \(16, 4\) with strides \(1, 16\)"),
    (lambda w: w[:, ::2], r"each run of ahead's rows must be contiguous"),
    (lambda w: w[0], r"ahead must be rows \[R, K\] or runs of rows \[P, R, K\], got shape \(16,\)"),
    (lambda w: w.to("meta"), r"ahead must be on cpu, got meta"),
    (lambda w: w[:, 1:], r"each run of ahead's rows must be contiguous"),
    (lambda w: w[:1, :4], r"ahead's runs must be 16-byte aligned and a multiple of 16 bytes, got shape \(1, 4\)"),
    (lambda w: w.reshape(-1)[1:9].view(1, 8), r"ahead's runs must be 16-byte aligned"),
    (lambda w: "w", r"ahead must be a torch.Tensor or None, got str"),
]


@pytest.mark.parametrize("op", ["gemv_residual", "norm_gemv_logits"])
@pytest.mark.parametrize("change,message", BAD_AHEAD)
def test_bad_ahead(op, change, message):
    args = args_of(op)
    with pytest.raises(ValueError, match=rf"^{op}: {message}"):
        getattr(ops, op)(*args, ahead=change(args[1 if op == "gemv_residual" else 3]))


@requires_cuda_kernels
def test_bad_ahead_reaching_the_op_is_a_value_error():
    """Past the Python wrapper, the C++ op checks the hint itself: a ValueError naming the op, never a fault."""
    x, w = linear_inputs(2, 64, 16, torch.bfloat16, "cuda")
    r = torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda")
    for bad, message in ((w.t(), "each run of ahead's rows must be contiguous"), (w[0], "ahead must be rows"),
                         (w.cpu(), "ahead must be on the same device")):
        with pytest.raises(ValueError, match=rf"gemv_residual: {message}"):
            torch.ops.higgs_rt.gemv_residual(x, w, r, bad)


@pytest.mark.parametrize("change,name", [
    (lambda a: a[:5] + (a[5][:1],) + a[6:], "lengths"),
    (lambda a: a[:4] + (a[4].double(),) + a[5:], "inv_freq"),
    (lambda a: a[:5] + (a[5],) + (a[6][:, :1],) + a[7:], "k_cache"),  # a slot slice: written in place, not copied
    (lambda a: a[:7] + (a[7][:, :1].clone(),), "caches"),
    (lambda a: a[:6] + (a[6][0],) + a[7:], "k_cache"),
    (lambda a: a[:3] + (a[3][:-8],) + a[4:], "w"),
])
def test_norm_qkv_rope_bad_arguments(change, name):
    args = qkv_inputs(2, 4, 2, 16, 64, 10, torch.bfloat16, "cpu")
    args = (args[0], args[1], EPS) + args[2:]
    with pytest.raises(ValueError, match=rf"^norm_qkv_rope: {name}\b"):
        ops.norm_qkv_rope(*change(args), 0)
    for layer in (2, -1, 0.5, None):
        with pytest.raises(ValueError, match=rf"^norm_qkv_rope: layer must be an int from 0 to 1, got {layer}$"):
            ops.norm_qkv_rope(*args, layer)


def test_norm_qkv_rope_writes_the_callers_caches_or_refuses_them():
    """The caches are written in place: a cache that is not contiguous (a slot slice, a transposed view) is
    refused, never copied (the writes would go to the copy and the caller's cache would stay as it was)."""
    x, g, w, inv_freq, lengths, k, v = qkv_inputs(2, 4, 2, 16, 64, 16, torch.bfloat16, "cpu")
    slots = torch.zeros(2, 3, 2, 16, 16, dtype=torch.bfloat16)[:, :2]
    for name, caches in (("k_cache", (slots, v)), ("v_cache", (k, v.transpose(3, 4)))):
        before = [c.clone() for c in caches]
        with pytest.raises(ValueError, match=rf"^norm_qkv_rope: {name} is written in place, so it must be "
                                             r"contiguous, got shape \(2, 2, 2, 16, 16\) with strides \("):
            ops.norm_qkv_rope(x, g, EPS, w, inv_freq, lengths, *caches, 1)
        assert all(torch.equal(c, b) for c, b in zip(caches, before))
    want_k, want_v = k.clone(), v.clone()
    ops.norm_qkv_rope_ref(x, g, EPS, w, inv_freq, lengths, want_k, want_v, 1)
    ops.norm_qkv_rope(x, g, EPS, w, inv_freq, lengths, k, v, 1)
    assert torch.equal(k, want_k) and torch.equal(v, want_v) and not torch.equal(k, before[0])


# --------------------------------------------------------------------------- torch.library / fake / compile


def test_fake_tensor_mode_uses_the_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.zeros(8, 3072, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        y = torch.ops.higgs_rt.gemv(x, torch.zeros(8208, 3072, dtype=torch.bfloat16, device=x.device))
        assert y.shape == (8, 8208) and y.dtype == torch.bfloat16
        g = torch.zeros(3072, dtype=torch.bfloat16, device=x.device)
        h = torch.ops.higgs_rt.norm_gemv_silu(x, g, EPS, torch.zeros(16384, 3072, dtype=torch.bfloat16, device=x.device))
        assert h.shape == (8, 8192)
        logits = torch.ops.higgs_rt.norm_gemv_logits(x, g, EPS, torch.zeros(8208, 3072, dtype=torch.bfloat16,
                                                                                   device=x.device))
        assert logits.dtype == torch.float32
        cache = torch.zeros(28, 8, 8, 4096, 128, dtype=torch.bfloat16, device=x.device)
        q = torch.ops.higgs_rt.norm_qkv_rope(x, g, EPS, torch.zeros(5120, 3072, dtype=torch.bfloat16, device=x.device),
                                            torch.zeros(64, device=x.device), torch.zeros(8, dtype=torch.int64,
                                                                                           device=x.device),
                                            cache, cache, 3)
        assert q.shape == (8, 24, 128)


def mlp(x, g, w13, w2):
    return ops.gemv_residual(ops.norm_gemv_silu(x, g, EPS, w13), w2, x, ahead=w13.view(2, -1, w13.shape[1])[:, :2])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x, w13 = linear_inputs(3, 128, 96, torch.bfloat16, device)
    _, w2 = linear_inputs(3, 48, 128, torch.bfloat16, device, seed=2)
    g = norm_weight(128, torch.bfloat16, device)
    got = torch.compile(mlp, fullgraph=True)(x, g, w13, w2)
    with ops.references():
        want = mlp(x, g, w13, w2)
    close(got, want, torch.bfloat16)


# --------------------------------------------------------------------------- CUDA kernels


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("k,n", REAL_GEMV)
def test_gemv_cuda_real_shapes(k, n, b, dtype):
    x, w = linear_inputs(b, k, n, dtype, "cuda", seed=k + n + b)
    y = ops.gemv(x, w)
    assert y.shape == (b, n) and y.is_contiguous()
    close(y, x.double() @ w.double().t(), dtype)


@requires_cuda_kernels
@pytest.mark.parametrize("b", [1, 3, 8, 12, 40])
@pytest.mark.parametrize("k,n", [
    (8, 1), (8, 16), (16, 7), (24, 17), (40, 33), (264, 100), (1032, 31), (2048, 250), (4096, 4099), (4104, 48),
    (3072, 1), (8192, 24),
])
def test_gemv_cuda_odd_shapes(k, n, b):
    x, w = linear_inputs(b, k, n, torch.bfloat16, "cuda", seed=k * 7 + n + b)
    close(ops.gemv(x, w), x.double() @ w.double().t(), torch.bfloat16)


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_gemv_cuda_fallbacks(dtype):
    """K % 8 != 0 and unaligned operands take the torch path; results are the same."""
    x, w = linear_inputs(3, 100, 40, dtype, "cuda")
    close(ops.gemv(x, w), x.double() @ w.double().t(), dtype)
    x, w = linear_inputs(3, 64, 40, dtype, "cuda")
    x_odd = torch.empty(3 * 64 + 1, device="cuda", dtype=dtype)[1:].view(3, 64).copy_(x)
    assert x_odd.data_ptr() % 16 != 0
    close(ops.gemv(x_odd, w), x.double() @ w.double().t(), dtype)


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("b", BATCHES)
def test_fused_epilogues_cuda(b, dtype):
    k = 3072
    x, w13 = linear_inputs(b, k, 2 * 1024, dtype, "cuda", seed=b)
    h, w2 = linear_inputs(b, 1024, k, dtype, "cuda", seed=b + 1)
    g = norm_weight(k, dtype, "cuda")
    r = torch.randn(b, k, device="cuda").to(dtype)
    close(ops.gemv_residual(h, w2, r), r.double() + h.double() @ w2.double().t(), dtype, scale=2)
    pre = normed64(x, g) @ w13.double().t()
    # the norm epilogues round x * norm_weight to dtype before the products: one more rounding, twice the slack
    close(ops.norm_gemv_silu(x, g, EPS, w13), F.silu(pre[:, :1024]) * pre[:, 1024:], dtype, scale=2)
    logits = ops.norm_gemv_logits(x, g, EPS, w13)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(dtype).float())
    close(logits, pre, dtype, scale=2)


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("b", [1, 4, 8, 13, 64])
@pytest.mark.parametrize("hq,hkv,d", [(24, 8, 128), (8, 8, 64), (4, 1, 128)])
def test_norm_qkv_rope_cuda(b, hq, hkv, d, dtype):
    args = qkv_inputs(b, hq, hkv, d, 512, 300, dtype, "cuda", seed=b + hq)
    x, g, w, inv_freq, lengths, kc, vc = args
    want_q, want_k, want_v = qkv64(*args, layer=1)
    q = ops.norm_qkv_rope(x, g, EPS, w, inv_freq, lengths, kc, vc, 1)
    close(q, want_q, dtype, scale=2)
    close(kc, want_k, dtype, scale=2)
    close(vc, want_v, dtype, scale=2)


@requires_cuda_kernels
@pytest.mark.parametrize("k,n", REAL_GEMV)
def test_gemv_cuda_is_batch_invariant(k, n):
    """A row's result is bit-identical whatever the batch size and whatever the other rows hold."""
    x, w = linear_inputs(64, k, n, torch.bfloat16, "cuda", seed=k + n)
    g = norm_weight(k, torch.bfloat16, "cuda")
    alone = ops.gemv(x[:1], w)
    for b in (2, 8, 9, 16, 31, 64):
        other = torch.randn(b, k, device="cuda").bfloat16()
        other[0] = x[0]
        assert torch.equal(ops.gemv(other, w)[0], alone[0]), f"B={b}"
        res = torch.randn(b, n, device="cuda").bfloat16()
        assert torch.equal(ops.gemv_residual(other, w, res)[0], ops.gemv_residual(x[:1], w, res[:1])[0]), f"B={b}"
        if n % 16 == 0:
            assert torch.equal(ops.norm_gemv_silu(other, g, EPS, w)[0], ops.norm_gemv_silu(x[:1], g, EPS, w)[0])
        assert torch.equal(ops.norm_gemv_logits(other, g, EPS, w)[0], ops.norm_gemv_logits(x[:1], g, EPS, w)[0])


@requires_cuda_kernels
@pytest.mark.parametrize("k", [3072, 1000, 2056])
def test_norm_gemvs_are_batch_invariant_across_the_prenorm_pass(k):
    """From 17 rows on the norm runs in a pre-pass kernel (ops.h, kGemvPrenormMinRows) that must sum the squares
    in the fused kernel's order: a row's q, keys, values, SwiGLU and logits have batch 1's bits at 17, 31 and 64
    rows, whatever the other rows hold, also where K is not whole rounds of the kernel's k-split and where the
    tiles end inside a block."""
    hq, hkv, d, s = 8, 2, 128, 64
    x, g, w, inv_freq, lengths, kc, vc = qkv_inputs(64, hq, hkv, d, k, s, torch.bfloat16, "cuda", seed=k)
    q1 = ops.norm_qkv_rope(x[:1], g, EPS, w, inv_freq, lengths[:1], kc, vc, 1)
    w_odd = linear_inputs(1, k, 80, torch.bfloat16, "cuda", seed=k + 1)[1]
    pos = int(lengths[0].clamp(0, s - 1))
    k1, v1 = kc[1, 0, :, pos].clone(), vc[1, 0, :, pos].clone()
    for b in (16, 17, 31, 64):
        other = torch.randn(b, k, device="cuda").bfloat16() * (1 + torch.arange(b, device="cuda")[:, None])
        other[0] = x[0]
        kc.zero_(), vc.zero_()
        q = ops.norm_qkv_rope(other, g, EPS, w, inv_freq, lengths[:b], kc, vc, 1)
        assert torch.equal(q[0], q1[0]), b
        assert torch.equal(kc[1, 0, :, pos], k1) and torch.equal(vc[1, 0, :, pos], v1), b
        assert torch.equal(ops.norm_gemv_silu(other, g, EPS, w)[0], ops.norm_gemv_silu(x[:1], g, EPS, w)[0]), b
        assert torch.equal(ops.norm_gemv_logits(other, g, EPS, w)[0], ops.norm_gemv_logits(x[:1], g, EPS, w)[0]), b
        want = normed64(other, g) @ w.double().t()  # and the other rows are right too, not just row 0's bits
        close(ops.norm_gemv_logits(other, g, EPS, w), want, torch.bfloat16, scale=2)
        # 5 gate/up tiles: the last block's second tile is past the end
        silu = ops.norm_gemv_silu(other, g, EPS, w_odd)
        assert torch.equal(silu[0], ops.norm_gemv_silu(x[:1], g, EPS, w_odd)[0]), b
        pre = normed64(other, g) @ w_odd.double().t()
        close(silu, F.silu(pre[:, :40]) * pre[:, 40:], torch.bfloat16, scale=2)


@requires_cuda_kernels
@pytest.mark.parametrize("b", [17, 64])
def test_norm_gemvs_two_blocks_an_sm_keep_batch_ones_bits(b):
    """Pre-normed GEMVs whose grid of 2-tile blocks outnumbers the SMs run two blocks an SM with a shallower ring
    (gemv.cu, two_blocks_wanted): the same sums, so a row's q, keys, values, SwiGLU and logits have batch 1's bits,
    and every row is right."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n, hkv = 3072, 32 * (sms + 8), sms // 20 + 1  # gate/up and logits: sms + 8 blocks; q/k/v: 5 hkv * 4 > sms
    x, w = linear_inputs(b, k, n, torch.bfloat16, "cuda", seed=b)
    x = x * (1 + torch.arange(b, device="cuda")[:, None]).bfloat16()
    g = norm_weight(k, torch.bfloat16, "cuda")
    silu = ops.norm_gemv_silu(x, g, EPS, w)
    assert torch.equal(silu[0], ops.norm_gemv_silu(x[:1], g, EPS, w)[0])
    pre = normed64(x, g) @ w.double().t()
    close(silu, F.silu(pre[:, :n // 2]) * pre[:, n // 2:], torch.bfloat16, scale=2)
    logits = ops.norm_gemv_logits(x, g, EPS, w)
    assert torch.equal(logits[0], ops.norm_gemv_logits(x[:1], g, EPS, w)[0])
    close(logits, pre, torch.bfloat16, scale=2)
    args = qkv_inputs(b, 3 * hkv, hkv, 128, k, 64, torch.bfloat16, "cuda", seed=b)
    xq, gq, wq, inv_freq, lengths, kc, vc = args
    want_q, want_k, want_v = qkv64(*args, layer=1)
    kc1, vc1 = kc.clone(), vc.clone()
    q1 = ops.norm_qkv_rope(xq[:1], gq, EPS, wq, inv_freq, lengths[:1], kc1, vc1, 1)
    q = ops.norm_qkv_rope(xq, gq, EPS, wq, inv_freq, lengths, kc, vc, 1)
    assert torch.equal(q[0], q1[0]) and torch.equal(kc[1, 0], kc1[1, 0]) and torch.equal(vc[1, 0], vc1[1, 0])
    close(q, want_q, torch.bfloat16, scale=2)
    close(kc, want_k, torch.bfloat16, scale=2)
    close(vc, want_v, torch.bfloat16, scale=2)


def tiled_row_counts():
    """Row counts (N) for the tiled kernel (gemv_tiled.cu, above 16 slots, K % 1024 == 0) on a GPU of ~132 SMs:
    3072 and 5120 (24 and 40 blocks of 128 rows, whose k-split would be spread over 8 and 4 blocks: gemv.cu's
    kernel at these K unless $HIGGS_RT_GEMV_TILED_G forces the split), a partial last block, N % 16 != 0, and as
    many blocks as SMs (not split)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [3072, 5120, 3120, 1000, 128 * sms]


def normed_as_the_kernels(x, g):
    """RMSNorm as the norm GEMVs compute it: x * norm_weight rounded to x's dtype, times rsqrt(mean(x^2) + eps)."""
    scale = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    return (x.float() * g.float()).to(x.dtype).double() * scale


@requires_cuda_kernels
@pytest.mark.parametrize("b", [17, 32, 33, 64])
@pytest.mark.parametrize("k", [1024, 3072])
def test_tiled_gemvs_give_every_row_batch_ones_bits(b, k):
    """Where the GEMVs run as a tiled GEMM (gemv_tiled.cu: by default at 17-64 rows for gate/up and down; for every
    shape here under $HIGGS_RT_GEMV_TILED_G, `gpu_run.sh tiled-tests@...`) it must make gemv.cu's sums in gemv.cu's
    order: every row of every epilogue has the bits the same row gets alone, split or not, and is right."""
    g = norm_weight(k, torch.bfloat16, "cuda")
    for n in tiled_row_counts():
        x, w = linear_inputs(b, k, n, torch.bfloat16, "cuda", seed=b + n)
        x = x * (1 + torch.arange(b, device="cuda")[:, None]).bfloat16()
        res = torch.randn(b, n, device="cuda").bfloat16()
        got = {
            "gemv": ops.gemv(x, w), "gemv_residual": ops.gemv_residual(x, w, res),
            "norm_gemv_silu": ops.norm_gemv_silu(x, g, EPS, w[:n // 16 * 16]),
            "norm_gemv_logits": ops.norm_gemv_logits(x, g, EPS, w),
        }
        for i in range(b):
            alone = {
                "gemv": ops.gemv(x[i:i + 1], w), "gemv_residual": ops.gemv_residual(x[i:i + 1], w, res[i:i + 1]),
                "norm_gemv_silu": ops.norm_gemv_silu(x[i:i + 1], g, EPS, w[:n // 16 * 16]),
                "norm_gemv_logits": ops.norm_gemv_logits(x[i:i + 1], g, EPS, w),
            }
            for op, y in got.items():
                assert torch.equal(y[i], alone[op][0]), f"{op} N={n} row {i} of {b}"
        close(got["gemv"], x.double() @ w.double().t(), torch.bfloat16, scale=b)
        close(got["gemv_residual"], res.double() + x.double() @ w.double().t(), torch.bfloat16, scale=b)
        pre = normed_as_the_kernels(x, g) @ w.double().t()
        close(got["norm_gemv_logits"], pre, torch.bfloat16, scale=2)
        half = n // 16 * 8
        close(got["norm_gemv_silu"], F.silu(pre[:, :half]) * pre[:, half:2 * half], torch.bfloat16, scale=2)
    hq, hkv, d, s = 16, 4, 128, 64  # 24 heads of 128: q/k/v's 3072 rows
    xq, gq, wq, inv_freq, lengths, kc, vc = qkv_inputs(b, hq, hkv, d, k, s, torch.bfloat16, "cuda", seed=k + b)
    want_q, want_k, want_v = qkv64(xq, gq, wq, inv_freq, lengths, kc, vc, layer=1)
    kc_all, vc_all = kc.clone(), vc.clone()
    q = ops.norm_qkv_rope(xq, gq, EPS, wq, inv_freq, lengths, kc_all, vc_all, 1)
    close(q, want_q, torch.bfloat16, scale=2)
    close(kc_all, want_k, torch.bfloat16, scale=2)
    close(vc_all, want_v, torch.bfloat16, scale=2)
    for i in range(b):
        kc1, vc1 = kc[:, i:i + 1].clone(), vc[:, i:i + 1].clone()
        q1 = ops.norm_qkv_rope(xq[i:i + 1], gq, EPS, wq, inv_freq, lengths[i:i + 1], kc1, vc1, 1)
        assert torch.equal(q[i], q1[0]), f"q row {i} of {b}"
        assert torch.equal(kc_all[1, i], kc1[1, 0]) and torch.equal(vc_all[1, i], vc1[1, 0]), f"cache row {i} of {b}"


@requires_cuda_kernels
@pytest.mark.parametrize("b", [17, 64])
def test_tiled_down_projection_split_gives_every_row_batch_ones_bits(b):
    """The down projection's shape (8192 -> 3072) is where the tiled kernel splits each row block's k-split over 8
    blocks and adds their sums in a second kernel: every row has its bits alone, and the results are right."""
    x, w = linear_inputs(b, 8192, 3072, torch.bfloat16, "cuda", seed=b)
    res = torch.randn(b, 3072, device="cuda").bfloat16()
    y, yr = ops.gemv(x, w), ops.gemv_residual(x, w, res)
    for i in range(b):
        assert torch.equal(y[i], ops.gemv(x[i:i + 1], w)[0]), f"row {i} of {b}"
        assert torch.equal(yr[i], ops.gemv_residual(x[i:i + 1], w, res[i:i + 1])[0]), f"row {i} of {b}"
    close(y, x.double() @ w.double().t(), torch.bfloat16)
    close(yr, res.double() + x.double() @ w.double().t(), torch.bfloat16, scale=2)


@requires_cuda_kernels
def test_cuda_graph_replay_reads_new_inputs():
    x, w = linear_inputs(8, 3072, 1024, torch.bfloat16, "cuda")
    g = norm_weight(3072, torch.bfloat16, "cuda")
    graph, out = capture_graph(lambda: ops.norm_gemv_silu(x, g, EPS, w))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, ops.norm_gemv_silu_ref(x, g, EPS, w), torch.bfloat16, scale=2)


@requires_cuda_kernels
def test_cuda_ops_run_on_current_stream():
    x, w = linear_inputs(4, 3072, 5120, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = ops.gemv(x, w)
    stream.synchronize()
    close(y, x.double() @ w.double().t(), torch.bfloat16)
