"""Streaming vs offline codec decode at the released codec's shapes: SNR per chunk size, codec work per emitted
frame, and the cost of one codec call per chunk at the tiny test size.

Random weights (higgs_rt.fixtures.codec, size "full"; or --codec DIR), fp32, on the CPU or --device cuda (there the
chunk calls replay the codec's CUDA graphs, and `chunk_cost_ms` times them at the released shapes). One utterance of --frames
random frames is pushed into `StreamingDecoder` one delayed frame at a time, as the Talker emits them, with a
one-frame first chunk and each --chunks size after it, and compared with `Code2Wav.decode` of the whole utterance;
both are also compared with an fp64 decode (the offline path's own arithmetic in float64), which says how far fp32
rounding alone takes each. Work: latent frames through the decoder per frame of audio emitted (the stateful stream
decodes each frame once; the lag and the delay ramp add lag + Q - 1 frames per utterance), against the windowed
re-decode this replaced (10 left + 8 + 9 look-ahead frames decoded per 8 emitted: 3.4x), also timed.

    PYTHONPATH=. python benchmarks/bench_codec_stream.py [--frames 400] [--chunks 1 2 4 8] [--threads 1]
        [--device cuda] [--out FILE]
    PYTHONPATH=. python benchmarks/bench_codec_stream.py --device cuda --layers-only 8 64  # GPU time by layer

Prints a summary and writes benchmarks/results/codec_stream.json (codec_stream_gpu.json on CUDA).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.meta import kernel_profile, run_info
from higgs_rt.codec import StreamingCodec, StreamingDecoder, load_codec, receptive_field
from higgs_rt.codec.stateful import StatefulDecoder
from higgs_rt.fixtures.codec import delayed_frames, make_codec
from higgs_rt.ops import rvq_lookup_ref

RESULTS = Path(__file__).parent / "results"
OLD_WINDOW = (10, 8, 9)  # the replaced StreamingDecoder: left context, chunk, look-ahead (frames)


def snr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (test.double() - reference.double()).pow(2).sum()
    return float("inf") if noise == 0 else round(float(10 * torch.log10(reference.double().pow(2).sum() / noise)), 1)


@torch.inference_mode()
def fp64_decode(codec, codes: torch.Tensor) -> torch.Tensor:
    """The offline decode's arithmetic in float64 (the RVQ sum through the reference: the kernel takes no fp64)."""
    c = copy.deepcopy(codec).double()
    return c.acoustic_decoder(c.fc2(rvq_lookup_ref(codes[None], c.table)).transpose(1, 2))[0, 0]


def stream(codec, delayed: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int, int, float]:
    """-> (PCM, codec calls, latent frames decoded, seconds)."""
    decoder = StreamingDecoder(codec, first_chunk=1, chunk=chunk)
    push, counts = decoder._lanes.push, [0, 0]

    def counted(frames):
        counts[0] += frames.shape[1] > 0
        counts[1] += frames.shape[1]
        return push(frames)

    decoder._lanes.push = counted
    t0 = time.perf_counter()
    wav = torch.cat([decoder.push(frame[None]) for frame in delayed] + [decoder.flush()])
    return wav, counts[0], counts[1], time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn, iters: int) -> float:
    fn()
    samples = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(samples), 3)


def warm_push(codec, lanes: int, n: int):
    """A push of n random frames on `lanes` started lanes, after 3 untimed ones (graphed on CUDA)."""
    stream = StreamingCodec(codec, lanes, graph_widths=(n,))
    for lane in range(lanes):
        stream.start(lane)
    frames = torch.randint(0, codec.codebook_size, (lanes, n, codec.num_quantizers), device=codec.table.device)
    for _ in range(3):
        stream.push(frames)
    return lambda: stream.push(frames)


def chunk_cost_ms(codec, sizes: tuple[int, ...], iters: int, lanes: int = 1) -> dict[str, float]:
    """One steady-state codec call (`StreamingCodec.push`, `lanes` lanes) of n frames, median ms (graphed on
    CUDA)."""
    return {str(n): timed_ms(warm_push(codec, lanes, n), iters) for n in sizes}


def profile_push(codec, lanes: int, n: int) -> list[dict]:
    """The kernels of one graphed push of n frames on `lanes` lanes, by total time."""
    return kernel_profile(warm_push(codec, lanes, n))


def layer_times(codec, lanes: int, n: int, iters: int = 5) -> dict:
    """Where an eager push of n frames on `lanes` lanes spends the GPU's time, layer by layer (median us of
    `iters`): CUDA events around each `StatefulDecoder._layer_gemm`, queued behind a sleeping kernel so that
    launch gaps do not count. Each row names the layer's kind, input channels, rate and GEMM rows (lanes x n x
    rate); the prologue (RVQ lookup, fc2) and the delay line are the rows before and after."""
    decoder = StatefulDecoder(codec, lanes)
    device = codec.table.device
    codes = torch.randint(0, codec.codebook_size, (lanes, n, codec.num_quantizers), device=device)
    first = torch.full((lanes,), 50, dtype=torch.int64, device=device)
    length = torch.full((lanes,), 10 ** 6, dtype=torch.int64, device=device)
    marks: list = []
    layer_gemm = StatefulDecoder._layer_gemm

    def timed(layer, *args):
        marks.append((layer, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        marks[-1][1].record()
        out = layer_gemm(layer, *args)
        marks[-1][2].record()
        return out

    decoder._layer_gemm = timed
    samples: list[list[float]] = []
    for i in range(iters + 1):
        marks.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # the GPU waits while the host queues the whole push
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        decoder.step(codes, first, length)
        end.record()
        torch.cuda.synchronize()
        if i:  # the first is a warm-up
            row = [begin.elapsed_time(marks[0][1])]
            row += [a.elapsed_time(b) for _, a, b in marks]
            row += [marks[-1][2].elapsed_time(end), begin.elapsed_time(end)]
            samples.append(row)
    med = [1e3 * statistics.median(s[j] for s in samples) for j in range(len(samples[0]))]
    rows = [{"layer": "rvq+fc2", "us": round(med[0], 1)}]
    for (layer, _, _), us in zip(marks, med[1:-2]):
        rows.append({"layer": layer.kind, "channels": layer.channels, "rate": layer.rate,
                     "rows": lanes * n * layer.rate, "us": round(us, 1)})
    rows.append({"layer": "delay", "us": round(med[-2], 1)})
    return {"total_us": round(med[-1], 1), "layers": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=400, help="frames in the utterance (40 ms each)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="chunk sizes after the first")
    parser.add_argument("--codec", type=Path, help="codec dir (default: a random one at the released shapes)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per chunk-cost figure")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lanes", type=int, default=64, help="lanes of the batched push-cost figure (CUDA)")
    parser.add_argument("--layers-only", type=int, nargs="*", metavar="LANES",
                        help="only time an eager 8-frame push layer by layer at these lane counts (CUDA)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        codec = load_codec(args.codec or make_codec(Path(tmp) / "full", size="full", seed=0), device=device)
        if args.layers_only is not None:
            return layers_only(codec, device, args)
        tiny = load_codec(make_codec(Path(tmp) / "tiny", size="tiny", seed=0), device=device)
    q = codec.num_quantizers
    codes = torch.randint(0, codec.codebook_size, (args.frames, q), generator=torch.Generator().manual_seed(0))
    sync()
    t0 = time.perf_counter()
    offline = codec.decode(codes[None].to(device))[0].cpu()
    offline_s = time.perf_counter() - t0
    truth = fp64_decode(codec, codes.to(device)).cpu()
    delayed = delayed_frames(codes, codec.codebook_size)

    per_chunk = {}
    for chunk in args.chunks:
        wav, calls, decoded, seconds = stream(codec, delayed, chunk)
        wav = wav.cpu()
        per_chunk[str(chunk)] = {
            "samples": wav.shape[0], "lengths_equal": wav.shape == offline.shape,
            "bit_equal": bool(torch.equal(wav, offline)),
            "snr_vs_offline_db": snr_db(offline, wav), "snr_vs_fp64_db": snr_db(truth, wav),
            "max_abs_diff": float((wav - offline).abs().max()), "codec_calls": calls,
            "frames_decoded_per_frame": round(decoded / args.frames, 3),
            "ms_per_frame": round(1e3 * seconds / args.frames, 2),
        }
        print(f"chunk {chunk}: {per_chunk[str(chunk)]}")

    left, chunk, ahead = OLD_WINDOW
    window = torch.randint(0, codec.codebook_size, (1, left + chunk + ahead, q), device=device)
    windowed_ms = timed_ms(lambda: codec.decode(window), 5) / chunk
    result = {
        **run_info(device),
        "what": "StreamingDecoder (stateful, first chunk 1 frame) vs Code2Wav.decode of the whole utterance",
        "weights": str(args.codec) if args.codec else "random, released shapes (higgs_rt.fixtures.codec 'full')",
        "dtype": "float32", "path": "gemm" if StatefulDecoder(codec, 1).gemm else "conv", "threads": torch.get_num_threads(), "frames": args.frames,
        "receptive_field_frames": list(receptive_field(codec.config)),
        "offline_snr_vs_fp64_db": snr_db(truth, offline),
        "offline_ms_per_frame": round(1e3 * offline_s / args.frames, 2),
        "chunks": per_chunk,
        "min_snr_vs_offline_db": min(c["snr_vs_offline_db"] for c in per_chunk.values()),
        "replaced_windowed_decode": {"left_chunk_lookahead": list(OLD_WINDOW),
                                     "frames_decoded_per_frame": round((left + chunk + ahead) / chunk, 3),
                                     "ms_per_frame": round(windowed_ms, 2)},
        "tiny_chunk_cost_ms": chunk_cost_ms(tiny, (1, 8), args.iters),
        **({"chunk_cost_ms": chunk_cost_ms(codec, (1, 8, 18), args.iters),
            f"push_cost_ms_{args.lanes}_lanes": chunk_cost_ms(codec, (1, 2, 4, 8), args.iters, args.lanes),
            "profile_1_lane_8": profile_push(codec, 1, 8),
            f"profile_{args.lanes}_lanes_8": profile_push(codec, args.lanes, 8)} if device.type == "cuda" else {}),
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "chunks"}, indent=1))
    out = args.out or RESULTS / ("codec_stream_gpu.json" if device.type == "cuda" else "codec_stream.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def conv_accuracy(codec, lanes: int = 8, samples: int = 64) -> list[dict]:
    """Each of the decoder's convolutions (`gemm.prepare`) over random channels-last input: the largest error of
    `ops.codec_conv` (tensor cores) and of cuBLAS's IEEE SGEMM over im2col rows, against fp64, relative to the
    largest output."""
    from higgs_rt.codec.gemm import Residual, prepare
    from higgs_rt.codec.layers import ieee_fp32
    from higgs_rt.ops import codec_conv, codec_conv_ref, codec_conv_supported

    convs = [conv for item in prepare(codec.acoustic_decoder)
             for conv in ((item.conv1, item.conv2) if isinstance(item, Residual) else (item,))]
    rows, g = [], torch.Generator(device=codec.table.device).manual_seed(0)
    for conv in convs:
        c, n = conv.weight.shape[0] // conv.kernel, conv.weight.shape[1]
        x = torch.randn(lanes, samples + (conv.kernel - 1) * conv.dilation, c, generator=g, device=g.device)
        if not codec_conv_supported(x, n):
            continue
        args = (conv.weight, conv.bias, None, conv.kernel, conv.dilation)
        exact = codec_conv_ref(x.double(), *(a.double() if isinstance(a, torch.Tensor) else a for a in args))
        with ieee_fp32():
            sgemm = codec_conv_ref(x, *args)
        got = codec_conv(x, *args)
        scale = float(exact.abs().max())
        rows.append({"C": c, "N": n, "taps": conv.kernel, "dilation": conv.dilation,
                     "tensor_cores": float((got.double() - exact).abs().max()) / scale,
                     "sgemm": float((sgemm.double() - exact).abs().max()) / scale})
    return rows


def layers_only(codec, device: torch.device, args) -> None:
    if device.type != "cuda":
        raise SystemExit("--layers-only needs --device cuda")
    result = {**run_info(device), "what": "an eager StreamingCodec push of 8 frames, GPU time layer by layer",
              "conv_accuracy": conv_accuracy(codec), "profile_8_lanes_8": profile_push(codec, 8, 8),
              **{f"layers_{lanes}_lanes_8": layer_times(codec, lanes, 8) for lanes in args.layers_only or [8, 64]}}
    print(json.dumps(result, indent=1))
    out = args.out or RESULTS / "codec_layers_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
