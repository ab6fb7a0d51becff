"""ops.gemv and ops.decode_attention: torch references, validation, fake / compile paths, and (on a GPU)
the CUDA kernels against the references at the Talker's real shapes, odd shapes, every batch size, and
under CUDA-graph replay with lengths changing between replays."""

import math

import pytest
import torch

from higgs_rt import ops
from higgs_rt.generate import capture_graph

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.HAS_CUDA_KERNELS), reason="needs a CUDA GPU and a CUDA build of higgs_rt._C"
)
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
HALF = [torch.bfloat16, torch.float16]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]

# Talker decode shapes, K -> N: fused qkv, o, fused gate/up, down, audio head.
REAL_GEMV = [(3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072), (3072, 8208)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def close(actual, expected_fp32, dtype):
    """actual (in dtype) against an fp32 reference: one rounding to dtype plus fp32 accumulation noise."""
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected_fp32.float(), rtol=TOL[dtype], atol=TOL[dtype])


def linear_inputs(b, k, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)  # outputs ~ N(0, 1)
    return x.to(device, dtype), w.to(device, dtype)


def attention_inputs(b, hq, hkv, s, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g) * 1.5  # peaky enough softmax to notice wrong keys
    v = torch.randn(b, hkv, s, d, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def attention_loop(q, k, v, lengths):
    """Literal definition in fp64, slot by slot and head by head."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = min(max(int(lengths[i]), 0), s)
        for h in range(hq):
            if n == 0:
                continue
            kk, vv = k[i, h // (hq // hkv), :n].double(), v[i, h // (hq // hkv), :n].double()
            p = torch.softmax(kk @ q[i, h].double() / math.sqrt(d), dim=0)
            out[i, h] = p @ vv
    return out


def poison_past_lengths(cache, lengths):
    """A copy of cache with NaN at every position >= lengths[b]: the op must never read them."""
    out = cache.clone()
    for i, n in enumerate(lengths.tolist()):
        out[i, :, max(n, 0):] = float("nan")
    return out


# --------------------------------------------------------------------------- references (CPU)


def test_gemv_ref_matches_fp64():
    x, w = linear_inputs(3, 64, 20, torch.bfloat16, "cpu")
    close(ops.gemv_ref(x, w), x.double() @ w.double().t(), torch.bfloat16)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b,hq,hkv,s,d,lengths", [
    (2, 6, 2, 10, 16, [0, 10]), (3, 4, 4, 7, 8, [1, 5, 7]), (1, 8, 1, 12, 16, [12]), (2, 3, 3, 9, 4, [20, -2]),
])
def test_decode_attention_ref_matches_definition(dtype, b, hq, hkv, s, d, lengths):
    q, k, v = attention_inputs(b, hq, hkv, s, d, dtype, "cpu")
    lengths = torch.tensor(lengths)
    got = ops.decode_attention_ref(q, k, v, lengths)
    close(got, attention_loop(q, k, v, lengths), dtype)
    assert not got.isnan().any()


@pytest.mark.parametrize("dtype", HALF)
def test_gemv_cpu_is_the_reference(dtype):
    x, w = linear_inputs(4, 40, 9, dtype, "cpu")
    assert torch.equal(ops.gemv(x, w), ops.gemv_ref(x, w))


def test_decode_attention_cpu_is_the_reference():
    q, k, v = attention_inputs(2, 8, 2, 33, 64, torch.bfloat16, "cpu")
    lengths = torch.tensor([33, 0])
    assert torch.equal(ops.decode_attention(q, k, v, lengths), ops.decode_attention_ref(q, k, v, lengths))


def test_decode_attention_zero_length_gives_zeros():
    q, k, v = attention_inputs(2, 4, 2, 5, 16, torch.float32, "cpu")
    out = ops.decode_attention(q, k, v, torch.tensor([0, 3]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0


def test_attention_splits_depend_on_shapes_only(monkeypatch):
    monkeypatch.setattr(ops, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert ops._attention_splits(1, 24, 8, 4096, dev) == 66  # B = 1, 8 KV heads: 4 blocks per SM
    assert ops._attention_splits(8, 24, 8, 4096, dev) == 9
    assert ops._attention_splits(1, 24, 8, 16, dev) == 1  # at least 16 keys a split
    assert ops._attention_splits(1, 24, 8, 100, dev) == 7
    assert ops._attention_splits(64, 24, 8, 4096, dev) == 2
    assert ops._attention_splits(256, 24, 8, 4096, dev) == 1
    assert ops._attention_splits(1, 1, 1, 1 << 20, dev) == 256


# --------------------------------------------------------------------------- validation


def gemv_args():
    return linear_inputs(2, 16, 4, torch.bfloat16, "cpu")


def attention_args():
    q, k, v = attention_inputs(2, 4, 2, 6, 16, torch.bfloat16, "cpu")
    return q, k, v, torch.tensor([3, 6])


@pytest.mark.parametrize("call,name", [
    (lambda x, w: ops.gemv(x.float(), w.float()), "x"),
    (lambda x, w: ops.gemv(x[0], w), "x"),
    (lambda x, w: ops.gemv(x[:0], w), "x"),
    (lambda x, w: ops.gemv(x.repeat(5, 1), w), "x"),  # 10 rows > 8
    (lambda x, w: ops.gemv(x, w.half()), "w"),
    (lambda x, w: ops.gemv(x, w[:, :8]), "w"),
    (lambda x, w: ops.gemv(x, w[0]), "w"),
    (lambda x, w: ops.gemv(x, w.to("meta")), "w"),
    (lambda x, w: ops.gemv(x, "w"), "w"),
])
def test_gemv_bad_arguments(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call(*gemv_args())


@pytest.mark.parametrize("call,name", [
    (lambda q, k, v, n: ops.decode_attention(q.long(), k, v, n), "q"),
    (lambda q, k, v, n: ops.decode_attention(q[0], k, v, n), "q"),
    (lambda q, k, v, n: ops.decode_attention(q, k.float(), v, n), "k_cache"),
    (lambda q, k, v, n: ops.decode_attention(q, k[0], v, n), "k_cache"),
    (lambda q, k, v, n: ops.decode_attention(q, k[:1], v, n), "k_cache"),
    (lambda q, k, v, n: ops.decode_attention(q, k[..., :8], v, n), "k_cache"),
    (lambda q, k, v, n: ops.decode_attention(q[:, :3], k, v, n), "k_cache"),  # 2 KV heads do not divide 3
    (lambda q, k, v, n: ops.decode_attention(q, k, v[:, :, :5], n), "v_cache"),
    (lambda q, k, v, n: ops.decode_attention(q, k, v.half(), n), "v_cache"),
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n.int()), "lengths"),
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n[:1]), "lengths"),
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n.to("meta")), "lengths"),
])
def test_decode_attention_bad_arguments(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call(*attention_args())


def test_bindings_are_cuda_only():
    from higgs_rt import _C

    with pytest.raises(ValueError, match="CUDA only"):
        _C.gemv(0, 0, 0, 1, 1, 8, 1, -1, 0)
    with pytest.raises(ValueError, match="CUDA only"):
        _C.decode_attention(0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 128, 1, 1, -1, 0)
    with pytest.raises(ValueError, match="K % 8"):
        _C.gemv(0, 0, 0, 1, 1, 12, 1, 0, 0)
    with pytest.raises(ValueError, match="head dim"):
        _C.decode_attention(0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 96, 1, 1, 0, 0)


# --------------------------------------------------------------------------- torch.library / fake / compile


def op_samples(device):
    x, w = linear_inputs(3, 64, 24, torch.bfloat16, device)
    q, k, v = attention_inputs(2, 8, 2, 40, 64, torch.bfloat16, device)
    lengths = torch.tensor([40, 7], device=device)
    return [
        (torch.ops.higgs_rt.gemv.default, (x, w)),
        (torch.ops.higgs_rt.decode_attention.default, (q, k, v, lengths)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(2))
def test_opcheck(device, index):
    op, args = op_samples(device)[index]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(2))
def test_dispatcher_path_matches_reference(device, index):
    op, args = op_samples(device)[index]
    ref = [ops.gemv_ref, ops.decode_attention_ref][index]
    close(op(*args), ref(*args).float(), torch.bfloat16)


def test_fake_tensor_mode_uses_the_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = ops.gemv(torch.zeros(8, 3072, dtype=torch.bfloat16), torch.zeros(8208, 3072, dtype=torch.bfloat16))
        assert y.shape == (8, 8208) and y.dtype == torch.bfloat16
        q = torch.zeros(2, 24, 128, dtype=torch.float16)
        kv = torch.zeros(2, 8, 4096, 128, dtype=torch.float16)
        out = ops.decode_attention(q, kv, kv, torch.zeros(2, dtype=torch.int64))
        assert out.shape == (2, 24, 128) and out.dtype == torch.float16


def decode_step(x, w, q, k, v, lengths):
    return ops.gemv(x, w) * 2, ops.decode_attention(q, k, v, lengths) + 1


def decode_step_ref(x, w, q, k, v, lengths):
    return ops.gemv_ref(x, w) * 2, ops.decode_attention_ref(q, k, v, lengths) + 1


def decode_inputs(device, dtype=torch.bfloat16, s=64, seed=0):
    x, w = linear_inputs(2, 128, 48, dtype, device, seed)
    q, k, v = attention_inputs(2, 24, 8, s, 128, dtype, device, seed)
    return x, w, q, k, v, torch.tensor([s, 5], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    args = decode_inputs(device)
    compiled = torch.compile(decode_step, fullgraph=True)
    for got, want in zip(compiled(*args), decode_step_ref(*args)):
        close(got, want.float(), torch.bfloat16)


# --------------------------------------------------------------------------- CUDA kernels


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", REAL_GEMV)
def test_gemv_cuda_real_shapes(k, n, b, dtype):
    x, w = linear_inputs(b, k, n, dtype, "cuda", seed=k + n + b)
    y = ops.gemv(x, w)
    assert y.shape == (b, n) and y.is_contiguous()
    close(y, x.float() @ w.float().t(), dtype)


@requires_cuda_kernels
@pytest.mark.parametrize("b", range(1, 9))
@pytest.mark.parametrize("k,n", [
    (8, 1), (8, 16), (16, 7), (24, 17), (40, 33), (264, 100), (1032, 31), (2048, 250), (4096, 4099), (4104, 48),
    (3072, 1), (8192, 24),
])
def test_gemv_cuda_odd_shapes(k, n, b):
    x, w = linear_inputs(b, k, n, torch.bfloat16, "cuda", seed=k * 7 + n + b)
    close(ops.gemv(x, w), x.float() @ w.float().t(), torch.bfloat16)


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_gemv_cuda_fallbacks(dtype):
    """K % 8 != 0 and unaligned operands take the torch path; results are the same."""
    x, w = linear_inputs(3, 100, 40, dtype, "cuda")
    close(ops.gemv(x, w), x.float() @ w.float().t(), dtype)
    x, w = linear_inputs(3, 64, 40, dtype, "cuda")
    x_odd = torch.empty(3 * 64 + 1, device="cuda", dtype=dtype)[1:].view(3, 64).copy_(x)
    assert x_odd.data_ptr() % 16 != 0
    close(ops.gemv(x_odd, w), x.float() @ w.float().t(), dtype)


@requires_cuda_kernels
def test_gemv_cuda_non_contiguous_and_extreme_rows():
    x, w = linear_inputs(4, 512, 64, torch.bfloat16, "cuda")
    w = w.clone()
    w[5] *= 1000  # one large row must not leak into its neighbours
    x_t = x.t().contiguous().t()  # same values, transposed strides (the op makes it contiguous)
    y = ops.gemv(x_t, w).float()
    ref = x.float() @ w.float().t()
    torch.testing.assert_close(y[:, 5], ref[:, 5], rtol=1e-2, atol=10.0)
    keep = [i for i in range(64) if i != 5]
    torch.testing.assert_close(y[:, keep], ref[:, keep], rtol=1e-2, atol=1e-2)


ATTN_SHAPES = [  # b, hq, hkv, s, d
    (1, 24, 8, 4096, 128),  # the Talker at B = 1
    (8, 24, 8, 1024, 128),  # the Talker at B = 8
    (3, 8, 8, 300, 64),  # MHA
    (2, 16, 2, 257, 128),  # G = 8
    (2, 12, 1, 100, 64),  # G = 12: two head groups per KV head
    (4, 4, 2, 16, 128),  # one split
    (2, 10, 2, 77, 64),  # G = 5, padded to 8
    (2, 4, 4, 1, 128),  # S = 1
]


def slot_lengths(b, s, seed):
    """Lengths for b slots covering 0, 1, S and random values (the first slot gets S)."""
    fixed = [s, 0, 1, s, max(s - 1, 0)]
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, s + 1, (b,), generator=g).tolist()
    return torch.tensor([fixed[i] if i < len(fixed) else rand[i] for i in range(b)])


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b,hq,hkv,s,d", ATTN_SHAPES)
def test_decode_attention_cuda(b, hq, hkv, s, d, dtype):
    q, k, v = attention_inputs(b, hq, hkv, s, d, dtype, "cuda", seed=s + b)
    lengths = slot_lengths(b, s, seed=s).cuda()
    want = ops.decode_attention_ref(q, k, v, lengths)
    got = ops.decode_attention(q, poison_past_lengths(k, lengths), poison_past_lengths(v, lengths), lengths)
    assert got.shape == (b, hq, d)
    close(got, want.float(), dtype)
    assert not got.isnan().any()


@requires_cuda_kernels
@pytest.mark.parametrize("n", [1, 2, 3, 17, 31, 32, 33, 100, 1000, 4000, 4095, 4096])
def test_decode_attention_cuda_single_slot_lengths(n):
    q, k, v = attention_inputs(1, 24, 8, 4096, 128, torch.bfloat16, "cuda", seed=n)
    lengths = torch.tensor([n], device="cuda")
    got = ops.decode_attention(q, poison_past_lengths(k, lengths), poison_past_lengths(v, lengths), lengths)
    close(got, ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
@pytest.mark.parametrize("nsplit", [1, 2, 3, 64, 256])
def test_decode_attention_cuda_any_split_count(monkeypatch, nsplit):
    monkeypatch.setattr(ops, "_attention_splits", lambda *args: nsplit)
    q, k, v = attention_inputs(4, 24, 8, 2048, 128, torch.bfloat16, "cuda", seed=nsplit)
    lengths = torch.tensor([2048, 0, 1, 1500], device="cuda")
    got = ops.decode_attention(q, poison_past_lengths(k, lengths), poison_past_lengths(v, lengths), lengths)
    close(got, ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
def test_decode_attention_cuda_out_of_range_lengths_clamp():
    q, k, v = attention_inputs(3, 8, 2, 50, 64, torch.float16, "cuda")
    lengths = torch.tensor([-4, 51, 1 << 40], device="cuda")
    got = ops.decode_attention(q, k, v, lengths)
    close(got, ops.decode_attention_ref(q, k, v, lengths.clamp(0, 50)).float(), torch.float16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@requires_cuda_kernels
def test_decode_attention_cuda_unsupported_head_dim_falls_back():
    q, k, v = attention_inputs(2, 8, 2, 50, 16, torch.bfloat16, "cuda")  # tiny test configs use D = 16
    lengths = torch.tensor([50, 3], device="cuda")
    close(ops.decode_attention(q, k, v, lengths), attention_loop(q.cpu(), k.cpu(), v.cpu(), lengths.cpu()).cuda(),
          torch.bfloat16)


@requires_cuda_kernels
def test_decode_attention_cuda_strided_cache_view():
    """A slice of a per-layer cache [L, B, Hkv, S, D] (what the Talker holds) is contiguous: no copy needed."""
    q, _, _ = attention_inputs(2, 24, 8, 128, 128, torch.bfloat16, "cuda")
    cache = torch.randn(3, 2, 2, 8, 128, 128, device="cuda", dtype=torch.bfloat16)
    k, v = cache[1, 0], cache[1, 1]
    lengths = torch.tensor([128, 60], device="cuda")
    close(ops.decode_attention(q, k, v, lengths), ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
def test_cuda_graph_capture_and_replay_with_changing_lengths():
    s = 1024
    x, w = linear_inputs(4, 3072, 1024, torch.bfloat16, "cuda")
    q, k, v = attention_inputs(4, 24, 8, s, 128, torch.bfloat16, "cuda")
    lengths = torch.tensor([10, 500, s, 1], device="cuda")
    static = (x, w, q, k, v, lengths)

    def step(x, w, q, k, v, lengths):
        return ops.gemv(x, w), ops.decode_attention(q, k, v, lengths)

    graph, outputs = capture_graph(lambda: step(*static))
    g = torch.Generator(device="cuda").manual_seed(1)
    for new_lengths in ([11, 501, s, 2], [0, 0, 0, 0], [s, s, s, s], [1, 1023, 7, 333]):
        lengths.copy_(torch.tensor(new_lengths))
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        close(outputs[0], x.float() @ w.float().t(), torch.bfloat16)
        close(outputs[1], ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
def test_cuda_ops_run_on_current_stream():
    args = decode_inputs("cuda", s=512)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = decode_step(*args)
    stream.synchronize()
    for g, w in zip(got, decode_step_ref(*args)):
        close(g, w.float(), torch.bfloat16)
