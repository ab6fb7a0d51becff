"""Times each higgs_rt kernel against the torch ops it replaces; prints a markdown table, writes JSON.

On a GPU: real sizes (Q=8, K=1024, D=1024, H=3072, bf16), median of CUDA-event timings, both eager
(one op call, host overhead included) and CUDA-graph replay (device time). On CPU: small sizes and
perf_counter, a smoke test of the C++ kernels. Every kernel is checked against its reference first.
The decode GEMVs are timed against torch's F.linear (cuBLAS) plus the norms, RoPE, cache writes, residual adds
or SwiGLU they fuse; decode attention against masked SDPA; the fused sampler against FrameSampler's torch code;
the prompt forward's row-wise kernels and the codec's against their torch references (codec_conv against
cuBLAS's SGEMM over im2col rows).
For every fused kernel's rows a second table gives the achieved bandwidth: the bytes a call must move across HBM
at least once (each row's count is stated where it is made: the weights for the GEMVs, the K/V read for
attention, inputs read plus outputs written for the row-wise, codec and sampler kernels) per second, with the
inputs rotating through copies larger than L2 and, in the graph columns, 20 calls chained in one CUDA graph as
in the decode step. The codebook ops (delay_revert, rvq_lookup, dualffn_*) have times only.

    python benchmarks/bench_kernels.py [--iters 200] [--out benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.meta import run_info
from higgs_rt import ops
from higgs_rt.cuda_graph import capture_graph

ROOT = Path(__file__).resolve().parents[1]
Q, K = 8, 1024
EPS = 1e-5
# Talker decode GEMMs, K -> N: fused qkv, o, fused gate/up, down, audio head.
GEMV_SHAPES = [(3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072), (3072, 8208)]
# The streaming codec's layers (lanes m, window W, channels C, kept samples): one lane, and 64.
CODEC_SHAPES = [(1, 64, 512, 18), (64, 320, 256, 54)]
# The codec's convolutions over several lanes (lanes m, outputs W, channels C): an 8-frame push of 8 lanes at the
# 512- and 128-channel blocks, and of 64 lanes at the 32-channel one.
CONV_SHAPES = [(8, 64, 512), (8, 1280, 128), (64, 7680, 32)]


def masked_sdpa(q, k, v, lengths):
    """What a runtime does without decode_attention: SDPA in the cache dtype with a length mask."""
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :],
                                          enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]


def rms_norm(x, g):
    """The Talker's RMSNorm (fp32 statistics, output in x's dtype), unfused: its torch reference."""
    return ops.rms_norm_ref(x, g, EPS)


def unfused_silu(x, g, w):
    gate, up = F.linear(rms_norm(x, g), w).chunk(2, dim=-1)
    return F.silu(gate) * up


def unfused_logits(x, g, w):
    return F.linear(rms_norm(x, g), w).float()


def unfused_qkv(x, g, w, inv_freq, lengths, k_cache, v_cache, layer):
    """The torch step's attention input side: norm, projection, RoPE, cache write."""
    from higgs_rt.ops import rope

    b, d, hkv = x.shape[0], k_cache.shape[4], k_cache.shape[2]
    qkv = F.linear(rms_norm(x, g), w).view(b, -1, 1, d)
    pos = lengths.clamp(max=k_cache.shape[3] - 1)
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    hq = qkv.shape[1] - 2 * hkv
    q, k = rope(qkv[:, :hq], cos, sin), rope(qkv[:, hq:hq + hkv], cos, sin)
    rows = torch.arange(b, device=x.device)
    k_cache[layer][rows, :, pos] = k[:, :, 0]
    v_cache[layer][rows, :, pos] = qkv[:, hq + hkv:, 0]
    return q[:, :, 0]


def sampler_cases(device):
    from higgs_rt.sampling import FrameSampler, SamplingParams

    def sampler(b):
        s = FrameSampler(b, Q, K, device, 7)
        for slot in range(b):
            s.reset(slot, SamplingParams(seed=slot))
        return s

    for b in (1, 8, 64):
        logits = torch.randn(b, Q, K + 2, device=device) * 3
        lengths = torch.full((b,), 100, device=device)
        calls = copies((logits,), device.type == "cuda")

        def fused(x, s=sampler(b), n=lengths):
            s.frame.fill_(20)  # a fixed mid-utterance state, so every call does the same work
            return s.step(x, n)

        def reference(x, s=sampler(b), n=lengths):
            s.frame.fill_(20)
            with ops.references():
                return s.step(x, n)

        yield ("sample_frame", f"B={b} Q={Q} V={K + 2}", rotating(fused, calls), rotating(reference, calls),
               sampler_bytes(sampler(b), logits, lengths))


def sampler_bytes(s, logits: torch.Tensor, lengths: torch.Tensor) -> int:
    """Bytes one sampler step must move: the logits [B, Q, V] fp32, every state tensor (FrameSampler.STATE, the
    RAS history [B, W, Q] whole) and the KV lengths read; the codes [B, Q] int64 written, and the state it
    writes back: frame, eos_start, done, lengths ([B] each) and one history row [B, Q]."""
    state = [getattr(s, name) for name in s.STATE]
    written = [getattr(s, name) for name, w in s.STATE.items() if w and name != "history"]
    row = s.history[:, 0]  # [B, Q] int64: the history row written, and the codes' size
    return moved(logits, lengths, *state) + moved(lengths, *written) + 2 * moved(row)


def streamed(op: str, size: str, kernel, reference, args: tuple, cuda: bool):
    """A row timing kernel(*args) against reference(*args), both rotating through copies of args; its bytes:
    `traffic` (the distinct tensor arguments read once, the outputs written once)."""
    calls = copies(args, cuda)
    return op, size, rotating(kernel, calls), rotating(reference, calls), traffic(kernel, args)


def cases(device: torch.device):
    """(op, size label, kernel fn, unfused reference fn, bytes streamed or None): real sizes on CUDA, small on
    CPU. Each fused op is timed against the torch ops it replaces in the torch step."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    d, h = (1024, 3072) if cuda else (256, 512)
    table = torch.randn(Q, K, d, device=device).to(dtype)
    for t in (1, 25, 250) if cuda else (1, 25):
        delayed = torch.randint(0, K + 2, (1, t + Q - 1, Q), device=device)
        yield (
            "delay_revert", f"T={t}",
            lambda c=delayed: ops.delay_revert(c, K), lambda c=delayed: ops.delay_revert_ref(c, K), None,
        )
    for t in (1, 25, 250) if cuda else (1, 25):
        codes = torch.randint(0, K, (1, t, Q), device=device)
        yield (
            "rvq_lookup", f"T={t} D={d}",
            lambda c=codes: ops.rvq_lookup(c, table), lambda c=codes: ops.rvq_lookup_ref(c, table), None,
        )
    for n in (100, 400) if cuda else (100,):
        hidden = torch.randn(n, h, device=device).to(dtype)
        mask = torch.rand(n, device=device) < 0.5
        _, perm, _ = ops.dualffn_route_ref(hidden, mask)
        yield (
            "dualffn_route", f"N={n} H={h}",
            lambda x=hidden, m=mask: ops.dualffn_route(x, m), lambda x=hidden, m=mask: ops.dualffn_route_ref(x, m),
            None,
        )
        yield (
            "dualffn_unroute", f"N={n} H={h}",
            lambda x=hidden, p=perm: ops.dualffn_unroute(x, p), lambda x=hidden, p=perm: ops.dualffn_unroute_ref(x, p),
            None,
        )
    for m, w, c, _ in CODEC_SHAPES if cuda else CODEC_SHAPES[:1]:  # the codec's Snake (a C++ kernel on the CPU too)
        x, alpha = torch.randn(m, w, c, device=device), torch.rand(c, device=device) + 0.1
        yield streamed("snake", f"m={m} W={w} C={c}", ops.snake, ops.snake_ref, (x, alpha), cuda)
    if not cuda:  # the ops below are CUDA kernels; on the CPU they are their references
        return
    # The row-wise and codec rows' bytes: their inputs read and outputs written, once each (`traffic`).
    for t in (46, 393):  # the prompt forward's row-wise ops at bench_frame_latency's sentence and voice-clone prompts
        x, r = torch.randn(1, t, h, device=device).to(dtype), torch.randn(1, t, h, device=device).to(dtype)
        g, ga = (1 + 0.1 * torch.randn(2, h, device=device)).to(dtype)
        rows = torch.rand(1, t, device=device) < 0.8
        yield streamed("rms_norm", f"T={t} H={h} mixed", ops.rms_norm, ops.rms_norm_ref, (x, g, EPS, ga, rows), cuda)
        yield streamed("add_rms_norm", f"T={t} H={h} mixed", ops.add_rms_norm, ops.add_rms_norm_ref,
                       (x, r, g, EPS, ga, rows), cuda)
        qkv = torch.randn(1, t, 5120, device=device).to(dtype)
        angles = torch.arange(t, device=device)[None, :, None] * torch.rand(128, device=device)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        yield streamed("rope_qkv", f"T={t} 24+2x8 heads", ops.rope_qkv, ops.rope_qkv_ref, (qkv, cos, sin, 24, 8),
                       cuda)
        gu = torch.randn(t, 16384, device=device).to(dtype)
        yield streamed("silu_mul", f"T={t} I=8192", ops.silu_mul, ops.silu_mul_ref, (gu,), cuda)
    for m, w, c, keep in CODEC_SHAPES:
        x, state = torch.randn(m, w, c, device=device), torch.randn(m, keep, c, device=device)
        first, length = torch.zeros(m, dtype=torch.int64, device=device), torch.full((m,), 99, device=device)
        alpha = torch.rand(c, device=device) + 0.1
        args = (x, state, first, length, 8, 3, x, None, alpha)  # a residual unit's window: the add, Snake(full)
        yield streamed("codec_window", f"m={m} W={w} C={c} keep={keep}", ops.codec_window, ops.codec_window_ref,
                       args, cuda)
        products = torch.randn(7, w, c, device=device)
        yield streamed("tap_sum", f"K=7 W={w} C={c}", ops.tap_sum, ops.tap_sum_ref, (products, alpha, alpha), cuda)
    for m, w, c in CONV_SHAPES:  # a residual unit's k7 convolution, Snake after: tensor cores vs SGEMM over im2col
        x = torch.randn(m, w + 6, c, device=device)
        weight, bias = torch.randn(7 * c, c, device=device) / (7 * c) ** 0.5, torch.randn(c, device=device)
        alpha = torch.rand(c, device=device) + 0.1
        yield streamed("codec_conv", f"m={m} W={w} C={c} k7", ops.codec_conv, ops.codec_conv_ref,
                       (x, weight, bias, alpha, 7, 1), cuda)
    for kdim, n in GEMV_SHAPES:
        w = (torch.randn(n, kdim, device=device) / kdim ** 0.5).to(dtype)
        nbytes = moved(w)  # the weights: the GEMV rows count only them
        weights = copies(w, cuda)
        g = (1 + 0.1 * torch.randn(kdim, device=device)).to(dtype)
        for b in (1, 8, 32, 64):  # 32: the server's bucket of 17-32 slots (gemv_tiled.cu's BN = 32)
            x = torch.randn(b, kdim, device=device).to(dtype)
            calls = [(x, wi) for wi in weights]
            yield "gemv", f"B={b} {kdim}->{n}", rotating(ops.gemv, calls), rotating(F.linear, calls), nbytes
            if (kdim, n) in ((3072, 3072), (8192, 3072)):
                r = torch.randn(b, n, device=device).to(dtype)
                calls = [(x, wi, r) for wi in weights]
                yield ("gemv_residual", f"B={b} {kdim}->{n}", rotating(ops.gemv_residual, calls),
                       rotating(lambda x, w, r: r + F.linear(x, w), calls), nbytes)
            calls = [(x, g, EPS, wi) for wi in weights]
            if (kdim, n) == (3072, 16384):
                yield ("norm_gemv_silu", f"B={b} {kdim}->{n}", rotating(ops.norm_gemv_silu, calls),
                       rotating(lambda x, g, e, w: unfused_silu(x, g, w), calls), nbytes)
            if (kdim, n) == (3072, 8208):
                yield ("norm_gemv_logits", f"B={b} {kdim}->{n}", rotating(ops.norm_gemv_logits, calls),
                       rotating(lambda x, g, e, w: unfused_logits(x, g, w), calls), nbytes)
            if (kdim, n) == (3072, 5120):
                kc = torch.zeros(2, b, 8, 1024, 128, device=device, dtype=dtype)
                vc = torch.zeros_like(kc)
                inv = torch.rand(64, device=device)
                lengths = torch.full((b,), 100, device=device)
                calls = [(x, g, EPS, wi, inv, lengths, kc, vc, 1) for wi in weights]
                yield ("norm_qkv_rope", f"B={b} {kdim}->{n}", rotating(ops.norm_qkv_rope, calls),
                       rotating(lambda x, g, e, w, *rest: unfused_qkv(x, g, w, *rest), calls), nbytes)
    hq, hkv, s, hd = 24, 8, 4096, 128
    for b in (1, 8, 64):
        q = torch.randn(b, hq, hd, device=device).to(dtype)
        kc = torch.randn(b, hkv, s, hd, device=device).to(dtype)
        caches = copies(torch.stack([kc, torch.randn_like(kc)]), cuda)
        counters = ops.attention_counters(b, hq, device)
        for n in (100, 500, 2000) if b > 1 else (100, 1000, 4000):
            lengths = torch.full((b,), n, device=device, dtype=torch.int64)
            calls = [(q, kv[0], kv[1], lengths) for kv in caches]
            yield (
                "decode_attention", f"B={b} S={s} L={n}",
                rotating(lambda *a: ops.decode_attention(*a, counters), calls), rotating(masked_sdpa, calls),
                2 * b * hkv * n * hd * kc.element_size(),  # the live K and V read
            )
    yield from sampler_cases(device)


def moved(*tensors) -> int:
    """Bytes of the distinct tensors among `tensors` (other values skipped; a tensor given twice counts once)."""
    distinct = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def traffic(fn, args: tuple) -> int:
    """Bytes a call fn(*args) must move across HBM at least once: its distinct tensor arguments read, its output
    tensors written (from one call)."""
    out = fn(*args)
    return moved(*args) + moved(*(out if isinstance(out, tuple) else (out,)))


def copies(args, cuda: bool, total: int = 256 << 20, most: int = 4096) -> list:
    """args (a tensor, or a call's argument tuple) and clones of it (each tensor cloned, an alias staying one
    clone), over `total` bytes together on CUDA (at most `most`: tiny inputs stay latency-bound anyway): rotating
    through them, repeated calls stream from HBM as a decode step does (every layer has its own weights) instead
    of hitting L2 (50 MB on an H200)."""
    def clone(a):
        if isinstance(a, torch.Tensor):
            return a.clone()
        memo = {}
        for t in a:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = t.clone()
        return tuple(memo.get(id(t), t) for t in a)

    n = min(-(-total // moved(*(args if isinstance(args, tuple) else (args,)))), most) if cuda else 1
    return [args] + [clone(args) for _ in range(n - 1)]


def rotating(fn, calls):
    """A no-argument callable running fn on the next argument tuple of `calls`, round robin."""
    it = itertools.cycle(calls)
    return lambda: fn(*next(it))


def check(kernel, reference) -> None:
    torch.manual_seed(0)
    got = kernel()
    torch.manual_seed(0)
    want = reference()
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)  # the unfused ops round more often


def median_us(fn, device: torch.device, iters: int) -> float:
    """Median wall time of one call: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(10):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def graph_us(fn, iters: int, calls: int = 20) -> float | None:
    """Median device time of one call, from replaying a CUDA graph of `calls` calls; None if uncapturable."""
    try:
        graph, _ = capture_graph(lambda: [fn() for _ in range(calls)])
    except RuntimeError:
        return None
    return median_us(graph.replay, torch.device("cuda"), iters) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/kernels.json (kernels_cpu.json on CPU)")
    parser.add_argument("--ops", help="comma-separated op names to time (default: all)")
    args = parser.parse_args()
    only = set(args.ops.split(",")) if args.ops else None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    rows = []
    for op, size, kernel, reference, nbytes in cases(device):
        if only is not None and op not in only:
            continue
        check(kernel, reference)
        row = {"op": op, "size": size, "ref_us": median_us(reference, device, args.iters),
               "kernel_us": median_us(kernel, device, args.iters)}
        if cuda:
            row["ref_graph_us"] = graph_us(reference, args.iters)
            row["kernel_graph_us"] = graph_us(kernel, args.iters)
        if nbytes is not None:
            row["bytes"] = nbytes
        rows.append(row)

    result = run_info(device) | {"rows": rows}
    fmt = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    print(f"# higgs_rt kernels on {result['device']} (torch {result['torch']}, {result['commit']})\n")
    header = "| op | size | ref µs | kernel µs | speedup |"
    if cuda:
        header += " ref graph µs | kernel graph µs | graph speedup |"
    print(header)
    print("|" + "---|" * header.count(" |"))
    for r in rows:
        line = f"| {r['op']} | {r['size']} | {fmt(r['ref_us'])} | {fmt(r['kernel_us'])} | {ratio(r['ref_us'], r['kernel_us'])} |"
        if cuda:
            line += (f" {fmt(r['ref_graph_us'])} | {fmt(r['kernel_graph_us'])} |"
                     f" {ratio(r['ref_graph_us'], r['kernel_graph_us'])} |")
        print(line)

    streamed = [r for r in rows if "bytes" in r]
    if streamed:
        gbps = lambda r, key: None if r.get(key) is None else r["bytes"] / r[key] / 1e3  # noqa: E731  (B/µs -> GB/s)
        keys = ("ref_us", "kernel_us") + (("ref_graph_us", "kernel_graph_us") if cuda else ())
        print("\n| op | size | MB | " + " | ".join(k.replace("_us", " GB/s") for k in keys) + " |")
        print("|" + "---|" * (3 + len(keys)))
        for r in streamed:
            for k in keys:
                r[k.replace("_us", "_gbps")] = gbps(r, k)
            print(f"| {r['op']} | {r['size']} | {r['bytes'] / 1e6:.1f} | "
                  + " | ".join(fmt(r[k.replace('_us', '_gbps')]) for k in keys) + " |")

    out = args.out or ROOT / "benchmarks" / "results" / ("kernels.json" if cuda else "kernels_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
