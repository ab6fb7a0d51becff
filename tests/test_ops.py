"""Checks every compiled kernel in higgs_rt.ops (C++ and CUDA) against its pure-torch reference."""

import os
import subprocess

import pytest
import torch

from higgs_rt import ops
from higgs_rt.cuda_graph import capture_graph

K = 1024  # real codes per codebook; BOS = K, EOS = K + 1

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def assert_close(actual, expected):
    """Exact for integers, 1e-6 for fp32, one rounding step for 16-bit floats."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype and actual.device == expected.device
    if not actual.is_floating_point():
        assert torch.equal(actual, expected)
    elif actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)


def random_codes(shape, device, low=0, high=K):
    return torch.randint(low, high, shape, device=device)


# --------------------------------------------------------------------------- the extension itself


def test_library_is_built_and_registers_every_op():
    from higgs_rt.ops.library import native

    assert ops.HAS_EXTENSION
    assert native(torch.empty(1)), "CPU tensors must take the compiled path"
    schemas = {name: str(getattr(torch.ops.higgs_rt, name).default._schema) for name in (
        "delay_revert", "rvq_lookup", "dualffn_route", "dualffn_unroute", "gemv", "gemv_residual", "norm_gemv_silu",
        "norm_gemv_logits", "norm_qkv_rope", "decode_attention", "sample_frame")}
    # state an op writes is declared mutated in its schema, so compile and export never copy it
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in schemas["norm_qkv_rope"]
    assert "Tensor(a!) counters" in schemas["decode_attention"]
    assert "Tensor(e!) lengths" in schemas["sample_frame"]


def test_library_is_a_plain_shared_library():
    """Not a Python module: a C++ program can load it (it links libtorch_cpu, nothing Python)."""
    from higgs_rt.ops.library import library_path

    path = library_path()
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    assert "libtorch_cpu.so" in needed and "libpython" not in needed


@pytest.mark.skipif(os.environ.get("HIGGS_RT_REQUIRE_CUDA", "").upper() not in ("1", "ON", "TRUE", "YES"),
                    reason="HIGGS_RT_REQUIRE_CUDA not set")
def test_library_has_cuda_when_required():
    assert ops.HAS_CUDA_KERNELS
    assert "90a" in ops.CUDA_ARCHS and "80" in ops.CUDA_ARCHS


# --------------------------------------------------------------------------- delay revert


def apply_delay_pattern(aligned, bos=K, eos=K + 1):
    """[B, T, Q] -> [B, T + Q - 1, Q] with codebook k shifted k frames, BOS before and EOS after."""
    b, t, q = aligned.shape
    delayed = torch.full((b, t + q - 1, q), eos, dtype=aligned.dtype, device=aligned.device)
    for k in range(q):
        delayed[:, :k, k] = bos
        delayed[:, k:k + t, k] = aligned[:, :, k]
    return delayed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,t,q", [(1, 1, 1), (1, 1, 8), (2, 25, 8), (3, 7, 1), (1, 250, 8), (2, 5, 3)])
def test_delay_revert_inverts_the_pattern(device, b, t, q):
    aligned = random_codes((b, t, q), device)
    delayed = apply_delay_pattern(aligned)
    out = ops.delay_revert(delayed, K)
    assert_close(out, aligned)
    assert_close(out, ops.delay_revert_ref(delayed, K))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s,q,offset,length", [
    (40, 8, 0, None), (40, 8, 5, None), (40, 8, 5, 10), (40, 8, 33, None), (40, 8, 32, 1),
    (8, 8, 0, None), (7, 8, 0, None), (40, 1, 39, None), (40, 8, 0, 0), (10, 3, 8, None),
])
def test_delay_revert_windows_and_out_of_range(device, s, q, offset, length):
    codes = random_codes((2, s, q), device, low=-5, high=K + 5)  # negatives, BOS, EOS, garbage
    out = ops.delay_revert(codes, K, offset, length)
    expected = ops.delay_revert_ref(codes, K, offset, length)
    assert_close(out, expected)
    n = s - offset - q + 1 if length is None else length
    assert out.shape == (2, n, q)
    if n:
        assert out.min() >= 0 and out.max() <= K - 1
        assert torch.equal(out[:, 0, q - 1], codes[:, offset + q - 1, q - 1].clamp(0, K - 1))


@pytest.mark.parametrize("s,q,offset,length", [(6, 8, 0, None), (10, 3, 9, None), (10, 3, 0, 9), (10, 3, -1, None)])
def test_delay_revert_bad_window_is_value_error(s, q, offset, length):
    with pytest.raises(ValueError):
        ops.delay_revert(random_codes((1, s, q), "cpu"), K, offset, length)


# --------------------------------------------------------------------------- RVQ lookup


def rvq_lookup_loop(codes, table):
    """Literal definition: sum of clamped table rows, for checking the reference itself."""
    q, k, d = table.shape
    out = torch.zeros(*codes.shape[:2], d, dtype=torch.float32)
    for b in range(codes.shape[0]):
        for t in range(codes.shape[1]):
            for i in range(q):
                out[b, t] += table[i, int(codes[b, t, i].clamp(0, k - 1))].float()
    return out.to(table.dtype)


def test_rvq_lookup_ref_matches_definition():
    codes = random_codes((2, 3, 4), "cpu", low=-2, high=K + 2)
    table = torch.randn(4, K, 5)
    torch.testing.assert_close(ops.rvq_lookup_ref(codes, table), rvq_lookup_loop(codes, table))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b,t,q,k,d", [
    (1, 1, 8, K, 1024), (2, 25, 8, K, 1024), (1, 250, 8, K, 64), (3, 4, 1, 16, 8), (2, 3, 2, 5, 3), (1, 2, 8, K, 12),
])
def test_rvq_lookup(device, dtype, b, t, q, k, d):
    codes = random_codes((b, t, q), device, low=-3, high=k + 3)  # out-of-range codes clamp
    table = torch.randn(q, k, d, device=device).to(dtype)
    assert_close(ops.rvq_lookup(codes, table), ops.rvq_lookup_ref(codes, table))


@pytest.mark.parametrize("device", DEVICES)
def test_rvq_lookup_clamps_codes(device):
    table = torch.randn(2, 4, 8, device=device)
    codes = torch.tensor([[[-7, 4], [100, -1]]], device=device)
    expected = torch.stack([table[0, 0] + table[1, 3], table[0, 3] + table[1, 0]])[None]
    assert_close(ops.rvq_lookup(codes, table), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_rvq_lookup_unaligned_table(device):
    """A contiguous table whose storage offset breaks 16-byte alignment takes the scalar path."""
    table = torch.randn(8 * K * 16 + 1, device=device)[1:].view(8, K, 16)
    codes = random_codes((2, 5, 8), device)
    assert_close(ops.rvq_lookup(codes, table), ops.rvq_lookup_ref(codes, table))


@pytest.mark.parametrize("device", DEVICES)
def test_rvq_lookup_empty(device):
    table = torch.randn(8, K, 16, device=device)
    assert ops.rvq_lookup(random_codes((2, 0, 8), device), table).shape == (2, 0, 16)


# --------------------------------------------------------------------------- DualFFN routing


def masks(n, device):
    g = torch.Generator().manual_seed(n)
    return {
        "random": torch.rand(n, generator=g) < 0.4,
        "all_text": torch.zeros(n, dtype=torch.bool),
        "all_audio": torch.ones(n, dtype=torch.bool),
        "text_then_audio": torch.arange(n) >= n // 3,
    }


def check_route(hidden, mask):
    routed, perm, n_audio = ops.dualffn_route(hidden, mask)
    ref_routed, ref_perm, ref_n_audio = ops.dualffn_route_ref(hidden, mask)
    assert_close(perm, ref_perm)
    assert_close(n_audio, ref_n_audio)
    assert n_audio.shape == () and n_audio.dtype == torch.int64
    assert torch.equal(routed, ref_routed)
    assert torch.equal(ops.dualffn_unroute(routed, perm), hidden)
    assert torch.equal(ops.dualffn_unroute(routed, perm), ops.dualffn_unroute_ref(routed, perm))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n,h", [(0, 16), (1, 16), (100, 64), (400, 24), (1500, 3), (3000, 8), (5, 1)])
@pytest.mark.parametrize("kind", ["random", "all_text", "all_audio", "text_then_audio"])
def test_dualffn_route(device, dtype, n, h, kind):
    hidden = torch.randn(n, h, device=device).to(dtype)
    check_route(hidden, masks(n, device)[kind].to(device))


def test_dualffn_route_ref_is_stable_text_first():
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    _, perm, n_audio = ops.dualffn_route_ref(torch.randn(6, 2), mask)
    assert perm.tolist() == [1, 3, 4, 0, 2, 5] and int(n_audio) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_dualffn_unroute_random_perm(device):
    y = torch.randn(300, 40, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(300, device=device)
    assert torch.equal(ops.dualffn_unroute(y, perm), ops.dualffn_unroute_ref(y, perm))


# --------------------------------------------------------------------------- validation


def cpu_args():
    codes = random_codes((1, 10, 8), "cpu")
    return codes, torch.randn(8, K, 16), torch.randn(6, 4), torch.zeros(6, dtype=torch.bool)


@pytest.mark.parametrize("call,name", [
    (lambda c, t, h, m: ops.delay_revert(c.float(), K), "codes"),
    (lambda c, t, h, m: ops.delay_revert(c[0], K), "codes"),
    (lambda c, t, h, m: ops.delay_revert(c, 0), "num_codes"),
    (lambda c, t, h, m: ops.rvq_lookup(c.int(), t), "codes"),
    (lambda c, t, h, m: ops.rvq_lookup(c, t.long()), "table"),
    (lambda c, t, h, m: ops.rvq_lookup(c, t[:4]), "table"),
    (lambda c, t, h, m: ops.rvq_lookup(c, t[0]), "table"),
    (lambda c, t, h, m: ops.rvq_lookup(c, t.to("meta")), "table"),
    (lambda c, t, h, m: ops.dualffn_route(h, m.int()), "audio_mask"),
    (lambda c, t, h, m: ops.dualffn_route(h, m[:5]), "audio_mask"),
    (lambda c, t, h, m: ops.dualffn_route(h[0], m), "hidden"),
    (lambda c, t, h, m: ops.dualffn_route(h.long(), m), "hidden"),
    (lambda c, t, h, m: ops.dualffn_route(h, m.to("meta")), "audio_mask"),
    (lambda c, t, h, m: ops.dualffn_unroute(h, torch.arange(5)), "perm"),
    (lambda c, t, h, m: ops.dualffn_unroute(h, torch.arange(6).int()), "perm"),
    (lambda c, t, h, m: ops.dualffn_unroute(h.long(), torch.arange(6)), "y"),
])
def test_bad_arguments_raise_value_error(call, name):
    with pytest.raises(ValueError, match=name):
        call(*cpu_args())


def test_dtype_message():
    with pytest.raises(ValueError, match="delay_revert: codes must be int64, got float32"):
        ops.delay_revert(torch.zeros(1, 9, 8), K)


def test_cpp_errors_name_the_op_the_argument_and_its_shape():
    """What a graph calling the registered ops directly (no wrapper) gets: a ValueError, as from the wrappers."""
    hop = torch.ops.higgs_rt
    with pytest.raises(ValueError, match=r"^higgs_rt::delay_revert: codes must be Long, got Float \[1, 9, 8\]"):
        hop.delay_revert(torch.zeros(1, 9, 8), K, 0, 2)
    with pytest.raises(ValueError, match=r"rvq_lookup: table must be float32, bfloat16 or float16, got Long "
                                         r"\[8, 4, 2\]"):
        hop.rvq_lookup(random_codes((1, 2, 8), "cpu"), torch.zeros(8, 4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"rvq_lookup: codes must be contiguous, got \[1, 2, 8\] with strides "
                                         r"\[32, 16, 2\]"):
        hop.rvq_lookup(random_codes((1, 2, 16), "cpu")[..., ::2], torch.zeros(8, 4, 2))


@pytest.mark.parametrize("perm,got", [([0, 1, 2, 3, 4, 6], r"perm\[5\] = 6$"),
                                      ([-1, 1, 2, 3, 4, 5], r"perm\[0\] = -1$"),
                                      ([0, 1, 2, 2, 4, 5], r"perm\[3\] = 2 twice$")])
def test_dualffn_unroute_cpu_refuses_a_perm_that_is_not_a_permutation(perm, got):
    """Rows no entry names would be left unwritten: the CPU kernel raises (the CUDA one, without a host sync,
    cannot; its docstring says so)."""
    with pytest.raises(ValueError, match=r"^higgs_rt::dualffn_unroute: perm must be a permutation of 0 \.\. N - 1 "
                                         rf"\(N = 6\), got {got}"):
        ops.dualffn_unroute(torch.randn(6, 4), torch.tensor(perm))


def test_non_contiguous_inputs():
    codes = random_codes((2, 8, 20), "cpu")[..., ::2]  # [2, 8, 10] strided
    table = torch.randn(10, K, 4)
    assert_close(ops.rvq_lookup(codes, table), ops.rvq_lookup_ref(codes.contiguous(), table))
    hidden = torch.randn(16, 10).t()
    mask = torch.rand(10) < 0.5
    assert torch.equal(ops.dualffn_route(hidden, mask)[0], ops.dualffn_route_ref(hidden, mask)[0])


# --------------------------------------------------------------------------- torch.library / compile / graphs


def op_samples(device):
    codes = random_codes((2, 12, 8), device, low=-2, high=K + 2)
    table = torch.randn(8, K, 32, device=device)
    hidden = torch.randn(9, 16, device=device)
    mask = torch.rand(9, device=device) < 0.5
    perm = torch.randperm(9, device=device)
    return [
        (torch.ops.higgs_rt.delay_revert.default, (codes, K, 2, 3)),
        (torch.ops.higgs_rt.rvq_lookup.default, (codes, table)),
        (torch.ops.higgs_rt.dualffn_route.default, (hidden, mask)),
        (torch.ops.higgs_rt.dualffn_unroute.default, (hidden, perm)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(4))
def test_opcheck(device, index):
    op, args = op_samples(device)[index]
    torch.library.opcheck(op, args)


REFS = [ops.delay_revert_ref, ops.rvq_lookup_ref, ops.dualffn_route_ref, ops.dualffn_unroute_ref]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(4))
def test_dispatcher_path_matches_reference(device, index):
    """The registered op called directly (what compiled graphs and packages call) agrees with the reference."""
    op, args = op_samples(device)[index]
    got, want = op(*args), REFS[index](*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert_close(g, w)


def test_fake_tensor_mode_uses_the_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        codes = torch.zeros(2, 12, 8, dtype=torch.int64)
        assert ops.delay_revert(codes, K, 2, 3).shape == (2, 3, 8)
        assert ops.rvq_lookup(codes, torch.zeros(8, K, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
        routed, perm, n_audio = ops.dualffn_route(torch.zeros(5, 4), torch.zeros(5, dtype=torch.bool))
        assert routed.shape == (5, 4) and perm.shape == (5,) and n_audio.shape == () and n_audio.dtype == torch.int64
        assert ops.dualffn_unroute(routed, perm).shape == (5, 4)


def pipeline(delayed, table, hidden, mask):
    codes = ops.delay_revert(delayed, K)
    emb = ops.rvq_lookup(codes, table)
    routed, perm, n_audio = ops.dualffn_route(hidden, mask)
    return emb, ops.dualffn_unroute(routed * 2, perm), n_audio


def pipeline_ref(delayed, table, hidden, mask):
    codes = ops.delay_revert_ref(delayed, K)
    routed, perm, n_audio = ops.dualffn_route_ref(hidden, mask)
    return ops.rvq_lookup_ref(codes, table), ops.dualffn_unroute_ref(routed * 2, perm), n_audio


def pipeline_inputs(device):
    return (
        random_codes((2, 32, 8), device, low=-2, high=K + 2),
        torch.randn(8, K, 64, device=device),
        torch.randn(50, 64, device=device),
        torch.rand(50, device=device) < 0.5,
    )


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    args = pipeline_inputs("cpu")
    compiled = torch.compile(pipeline, fullgraph=True)
    for got, want in zip(compiled(*args), pipeline_ref(*args)):
        assert_close(got, want)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    static = pipeline_inputs("cuda")
    graph, outputs = capture_graph(lambda: pipeline(*static))
    for _ in range(2):
        fresh = pipeline_inputs("cuda")
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, pipeline_ref(*fresh)):
            assert_close(got, want)


@requires_cuda
def test_cuda_ops_run_on_current_stream():
    args = pipeline_inputs("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = pipeline(*args)
    stream.synchronize()
    for g, w in zip(got, pipeline_ref(*args)):
        assert_close(g, w)


def test_references_trace_as_plain_torch_ops():
    """What `higgs-rt export --kernels torch` relies on: inside ops.references() no higgs_rt op is traced, and the
    result is the same."""
    from tools.export.build import custom_ops

    class Uses(torch.nn.Module):
        def forward(self, codes, table, hidden, mask):
            routed, perm, _ = ops.dualffn_route(hidden, mask)
            return ops.rvq_lookup(codes, table), ops.dualffn_unroute(routed * 2, perm), ops.delay_revert(codes, 4)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 6, (1, 9, 3), generator=gen), torch.randn(3, 4, 8, generator=gen),
            torch.randn(5, 8, generator=gen), torch.tensor([True, False, True, True, False]))
    traced = torch.export.export(Uses(), args, strict=False)
    assert custom_ops(traced) == ["higgs_rt::delay_revert", "higgs_rt::dualffn_route", "higgs_rt::dualffn_unroute",
                                  "higgs_rt::rvq_lookup"]
    with ops.references():
        plain = torch.export.export(Uses(), args, strict=False)
        assert ops.using_references()
    assert not ops.using_references() and custom_ops(plain) == []
    for got, want in zip(plain.module()(*args), Uses()(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
