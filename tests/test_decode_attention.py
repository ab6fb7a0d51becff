"""ops.decode_attention: the torch reference against a literal definition, validation, and (on a GPU) the CUDA
kernel against the reference at the Talker's shapes, odd shapes, every length, batch invariance, and CUDA-graph
replay with lengths changing between replays."""

import math

import pytest
import torch

from conftest import run_switched
from higgs_rt import ops
from higgs_rt.cuda_graph import capture_graph

requires_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.HAS_CUDA_KERNELS), reason="needs a CUDA GPU and a CUDA build of higgs-rt"
)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


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


# --------------------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b,hq,hkv,s,d,lengths", [
    (2, 6, 2, 10, 16, [0, 10]), (3, 4, 4, 7, 8, [1, 5, 7]), (1, 8, 1, 12, 16, [12]), (2, 3, 3, 9, 4, [20, -2]),
])
def test_reference_matches_definition(dtype, b, hq, hkv, s, d, lengths):
    q, k, v = attention_inputs(b, hq, hkv, s, d, dtype, "cpu")
    lengths = torch.tensor(lengths)
    got = ops.decode_attention_ref(q, k, v, lengths)
    close(got, attention_loop(q, k, v, lengths), dtype)
    assert not got.isnan().any()


def test_cpu_is_the_reference():
    q, k, v = attention_inputs(2, 8, 2, 33, 64, torch.bfloat16, "cpu")
    lengths = torch.tensor([33, 0])
    assert torch.equal(ops.decode_attention(q, k, v, lengths), ops.decode_attention_ref(q, k, v, lengths))


def test_zero_length_gives_zeros():
    q, k, v = attention_inputs(2, 4, 2, 5, 16, torch.float32, "cpu")
    out = ops.decode_attention(q, k, v, torch.tensor([0, 3]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0


# --------------------------------------------------------------------------- validation


def attention_args():
    q, k, v = attention_inputs(2, 4, 2, 6, 16, torch.bfloat16, "cpu")
    return q, k, v, torch.tensor([3, 6])


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
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n, torch.zeros(8, dtype=torch.int64)), "counters"),
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n, torch.zeros(7, dtype=torch.int32)), "counters"),
    # written in place: a strided view is refused, not copied (on every device, not only where the kernel runs)
    (lambda q, k, v, n: ops.decode_attention(q, k, v, n, torch.zeros(16, dtype=torch.int32)[::2]), "counters"),
])
def test_bad_arguments(call, name):
    with pytest.raises(ValueError, match=rf"^decode_attention: {name}\b"):
        call(*attention_args())


def test_the_op_is_cuda_only():
    q, k, v, n = attention_args()
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.higgs_rt.decode_attention(q, k, v, n, torch.zeros(8, dtype=torch.int32))


# --------------------------------------------------------------------------- CUDA kernel

SHAPES = [  # b, hq, hkv, s, d
    (1, 24, 8, 4096, 128),  # the Talker at B = 1
    (1, 8, 8, 700, 128),  # MHA at B = 1 (whole-chunk loads, one query head a block)
    (1, 16, 8, 333, 128),  # G = 2 at B = 1
    (8, 24, 8, 1024, 128),  # the Talker at B = 8
    (64, 24, 8, 600, 128),  # the Talker at B = 64
    (3, 8, 8, 300, 64),  # MHA
    (2, 16, 2, 257, 128),  # G = 8
    (2, 12, 1, 100, 64),  # G = 12: two head groups per KV head
    (4, 4, 2, 16, 128),  # one chunk
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
@pytest.mark.parametrize("b,hq,hkv,s,d", SHAPES)
def test_cuda(b, hq, hkv, s, d, dtype):
    q, k, v = attention_inputs(b, hq, hkv, s, d, dtype, "cuda", seed=s + b)
    lengths = slot_lengths(b, s, seed=s).cuda()
    want = ops.decode_attention_ref(q, k, v, lengths)
    counters = ops.attention_counters(b, hq, "cuda")
    for _ in range(2):  # the counters are left zeroed for the next call
        got = ops.decode_attention(q, poison_past_lengths(k, lengths), poison_past_lengths(v, lengths), lengths,
                                   counters)
        assert got.shape == (b, hq, d)
        close(got, want.float(), dtype)
        assert not got.isnan().any()
        assert not counters.any()


@requires_cuda_kernels
@pytest.mark.parametrize("n", [1, 2, 3, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4000, 4095, 4096])
def test_cuda_single_slot_lengths(n):
    q, k, v = attention_inputs(1, 24, 8, 4096, 128, torch.bfloat16, "cuda", seed=n)
    lengths = torch.tensor([n], device="cuda")
    got = ops.decode_attention(q, poison_past_lengths(k, lengths), poison_past_lengths(v, lengths), lengths)
    close(got, ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
def test_cuda_is_batch_invariant():
    """A slot's output is bit-identical alone and among 7 or 63 others of other lengths and contents."""
    q, k, v = attention_inputs(64, 24, 8, 2048, 128, torch.bfloat16, "cuda", seed=5)
    lengths = torch.randint(1, 2049, (64,), device="cuda")
    lengths[0] = 1500
    alone = ops.decode_attention(q[:1], k[:1], v[:1], lengths[:1])
    for b in (2, 8, 33, 64):
        assert torch.equal(ops.decode_attention(q[:b], k[:b], v[:b], lengths[:b])[0], alone[0]), f"B={b}"


@requires_cuda_kernels
def test_cuda_out_of_range_lengths_clamp():
    q, k, v = attention_inputs(3, 8, 2, 50, 64, torch.float16, "cuda")
    lengths = torch.tensor([-4, 51, 1 << 40], device="cuda")
    got = ops.decode_attention(q, k, v, lengths)
    close(got, ops.decode_attention_ref(q, k, v, lengths.clamp(0, 50)).float(), torch.float16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@requires_cuda_kernels
def test_cuda_unsupported_head_dim_falls_back():
    q, k, v = attention_inputs(2, 8, 2, 50, 16, torch.bfloat16, "cuda")  # tiny test configs use D = 16
    lengths = torch.tensor([50, 3], device="cuda")
    close(ops.decode_attention(q, k, v, lengths), attention_loop(q.cpu(), k.cpu(), v.cpu(), lengths.cpu()).cuda(),
          torch.bfloat16)


@requires_cuda_kernels
def test_cuda_cache_view_of_one_layer():
    """A slice of a per-layer cache [L, B, Hkv, S, D] (what the Talker holds) is contiguous: no copy needed."""
    q, _, _ = attention_inputs(2, 24, 8, 128, 128, torch.bfloat16, "cuda")
    cache = torch.randn(3, 2, 2, 8, 128, 128, device="cuda", dtype=torch.bfloat16)
    k, v = cache[1, 0], cache[1, 1]
    lengths = torch.tensor([128, 60], device="cuda")
    close(ops.decode_attention(q, k, v, lengths), ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
def test_cuda_graph_replay_with_changing_lengths():
    s = 1024
    q, k, v = attention_inputs(4, 24, 8, s, 128, torch.bfloat16, "cuda")
    lengths = torch.tensor([10, 500, s, 1], device="cuda")
    counters = ops.attention_counters(4, 24, "cuda")
    graph, out = capture_graph(lambda: ops.decode_attention(q, k, v, lengths, counters))
    g = torch.Generator(device="cuda").manual_seed(1)
    for new_lengths in ([11, 501, s, 2], [0, 0, 0, 0], [s, s, s, s], [1, 1023, 7, 333]):
        lengths.copy_(torch.tensor(new_lengths))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, ops.decode_attention_ref(q, k, v, lengths).float(), torch.bfloat16)


@requires_cuda_kernels
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="thread-block clusters need sm_90")
@pytest.mark.parametrize("blocks", [8, 16])
def test_cuda_cluster_combine_keeps_the_bits(tmp_path, blocks):
    """$HIGGS_RT_ATTN_CLUSTER (measuring; decode_attention.cu): the chunks' partials merged through a cluster's
    shared memory give the default kernel's bits, on every batch path (one slot, the ring's 2-8 slots, more) and
    at lengths of one chunk, of a cluster's chunks and of many rounds of them."""
    cases = []
    for b, s, lengths in ((1, 4096, [1]), (1, 4096, [65]), (1, 4096, [100]), (1, 4096, [64 * blocks + 1]),
                          (1, 4096, [4000]), (8, 1024, None), (64, 600, None)):
        q, k, v = attention_inputs(b, 24, 8, s, 128, torch.bfloat16, "cuda", seed=b + s)
        lengths = torch.tensor(lengths) if lengths else slot_lengths(b, s, seed=b)
        cases.append((q, k, v, lengths.cuda()))
    (want, plain), (got, kernels) = run_switched("higgs_rt.ops.decode_attention", cases, "decode_attention_kernel",
                                                 tmp_path, "HIGGS_RT_ATTN_CLUSTER", (None, str(blocks)))
    assert plain and not [n for n in plain if ", true>" in n], plain  # the default kernel (CL false) made `want`
    clustered = [n for n in kernels if ", true>" in n]  # the kernel's CL template argument
    assert len(clustered) == len(cases), kernels
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"case {i}"
