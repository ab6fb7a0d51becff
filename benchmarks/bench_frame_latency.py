"""Per-frame latency and time to first audio, higgs-rt against transformers in the same run.

Full-size Talker and codec with random bf16 weights on the GPU (latency does not depend on weight values);
the tiny configs on the CPU. Both engines run exactly N frames regardless of EOS (transformers:
generate(max_new_tokens=N, eos_token_id=None)). Writes, by name:
  b1_ms, b8_ms (100 positions in), b64_ms (500 in), b1_ms_at_2000, b8_ms_at_500 (the server's 8-stream lengths):
      median ms per graphed step of the real decode loop (fused kernels on CUDA); b1_torch_step_ms: the plain
      torch step (ops.references()) graphed;
  kernels_per_step: kernel and memcpy activities of one graph replay (profiler), also for the torch step;
  step_profile (CUDA): that replay of the batch-1 step: span, busy time, per-kernel totals, what each of a
      layer's kernels adds to the step end to end (`layer`), the first layer's and the last activities with their
      start times (replay_profile); batch8/batch64 hold theirs;
  copy_GBs (measured here), achieved_GBs (weights read per step / b1_ms), fraction_of_copy;
  first_audio: a 20-word sentence through `TTS.stream` itself, the median of 20 warm runs of text in -> first
      PCM, with its terms: prompt_ms + prefill_sentence (prefill_ms), steps x b1_ms, and beyond_steps_ms, the rest,
      of which codec_ms is the codec's first-chunk call (codec_chunk_ms.first, timed apart);
  prefill_sentence, prefill_clone: the sentence's prompt (46 positions) and a voice-clone prompt of about 400
      positions (320 reference frames), the prompts built already, medians of 20 warm prefills;
  prefill_profile (CUDA): the kernels of one warm prefill of the sentence and of the clone prompt;
  admit_11 (batch-64 decoder): 11 sentence prompts (the batch engine's 512-token budget) started one by one
      against `Decoder.start_many` (batched forwards per bucket), medians of 10;
  transformers_ms_per_frame and the speedup; peak GPU memory (before transformers loads);
  import_torch_s and cold_start_s: `higgs-rt speak --verbose` in fresh processes on a random checkpoint on disk
      (the released layouts: Boson's Talker shards, its codec's model.pth) with page-cached weights (one untimed
      run first), medians of --cold-start-runs: import torch's own time, and from import torch returned to the
      first PCM chunk; `cold_start` holds every run and the stages (higgs_rt.timing) of the median one;
      cold_start_with_warmup_s: the same with TTS's warm-up utterance, which speak skips (runs alternate).
      Run first, before this process puts anything on the device.

    python benchmarks/bench_frame_latency.py [--frames 300] [--hf-frames 100] [--tokenizer DIR] [--out JSON]
        [--cold-start-runs 5] [--cold-start-model DIR] [--cold-start-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.meta import kernel_profile, p90, run_info
from higgs_rt import ops
from higgs_rt.codec import StreamingCodec, StreamingDecoder
from higgs_rt.config import TalkerConfig
from higgs_rt.engine import TTS
from higgs_rt.fixtures.talker import random_state
from higgs_rt.generate import Decoder, HostFrames
from higgs_rt.model import Model
from higgs_rt.prompt import PromptBuilder
from higgs_rt.sampling import SamplingParams
from higgs_rt.talker import Talker
from higgs_rt.weights import map_weights

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = ("The quick brown fox jumps over the lazy dog while the sun sets slowly behind the quiet hills "
            "and birds sing their evening songs.")  # 20 words


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Device copy bandwidth in GB/s, counting bytes read and written."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 20 / (time.perf_counter() - t0) / 1e9


def weight_bytes_per_step(cfg: TalkerConfig, elem: int) -> int:
    """Bytes one audio decode step reads: attention, audio FFN, audio norms, audio head (no text parts)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h + cfg.num_heads * d * h \
        + 3 * cfg.audio_intermediate_size * h + 2 * h
    return elem * (cfg.num_layers * per_layer + cfg.num_codebooks * cfg.codebook_vocab * h + h)


def replay_activities(graph: torch.cuda.CUDAGraph) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel, memcpy and memset of one replay of a CUDA graph (profiler),
    in start order, times from the first start."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    acts = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda a: a[1])
    if not acts:
        raise RuntimeError("the profiler saw no device activity in the graph replay")
    t0 = acts[0][1]
    return [(n, a - t0, b - t0) for n, a, b in acts]


def kernels_per_replay(graph: torch.cuda.CUDAGraph) -> int:
    """Kernel, memcpy and memset activities of one replay of a CUDA graph, counted with the profiler."""
    return len(replay_activities(graph))


def layer_breakdown(acts: list[tuple[str, float, float]]) -> dict | None:
    """What each kernel of a layer adds to the step, from (name, start, end) activities in start order: under PDL
    a kernel starts when the one before it lets it, so durations overlap and only ends count. A layer is the
    shortest period p of names that repeats over the middle of the step; kernel k's share is the median over the
    layers of its end minus the latest end before it. None without at least two whole periods."""
    names = [a[0] for a in acts]
    n = len(names)
    for p in range(1, n // 3 + 1):  # the step's first kernels (embedding, positions) are not a layer's: skip p
        if all(names[i] == names[i + p] for i in range(p, n - 2 * p)):
            break
    else:
        return None
    lo = next((j for j in range(p + 1) if names[j:j + p] == names[j + p:j + 2 * p]), None)  # the layers' start
    if lo is None:
        return None
    reach, gains = 0.0, []
    for _, _, b in acts:
        gains.append(max(0.0, b - reach))
        reach = max(reach, b)
    starts = [i for i in range(lo, n - p + 1, p) if names[i:i + p] == names[lo:lo + p]]
    if len(starts) < 2:
        return None
    def short(name: str) -> str:  # without its parameter list, the template's end (the epilogue) kept
        name = name[:name.index(">(") + 1] if ">(" in name else name
        return name if len(name) <= 100 else name[:60] + "..." + name[-40:]

    rows = []
    for k in range(p):
        per_layer = sorted(gains[i + k] for i in starts)
        rows.append({"kernel": short(names[lo + k]), "end_to_end_us": round(per_layer[len(per_layer) // 2], 2)})
    return {"layers": len(starts), "kernels_per_layer": p,
            "layer_us": round(sum(r["end_to_end_us"] for r in rows), 2), "kernels": rows}


def replay_profile(graph: torch.cuda.CUDAGraph, head: int = 14, tail: int = 6) -> dict:
    """Where one replay's time goes: its span (first start to last end), busy_us (the union of the activities'
    intervals: span - busy is time with nothing running), the sum of their durations (above busy where PDL
    overlaps kernels), each kernel name's calls and total us, a layer's kernels end to end (`layer_breakdown`),
    and the first `head` and last `tail` activities as (name, start, duration) rows: a layer's kernels and the
    step's end (head, sampler)."""
    acts = replay_activities(graph)
    busy, reach = 0.0, 0.0
    for _, a, b in acts:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    by_name: dict[str, list[float]] = {}
    for n, a, b in acts:
        by_name.setdefault(n, []).append(b - a)
    rows = sorted(({"kernel": n[:100], "calls": len(v), "us": round(sum(v), 1)} for n, v in by_name.items()),
                  key=lambda r: -r["us"])
    line = lambda a: {"kernel": a[0][:100], "start_us": round(a[1], 2), "us": round(a[2] - a[1], 2)}
    return {"activities": len(acts), "span_us": round(max(b for _, _, b in acts), 1), "busy_us": round(busy, 1),
            "sum_us": round(sum(b - a for _, a, b in acts), 1), "by_kernel": rows, "layer": layer_breakdown(acts),
            "first": [line(a) for a in acts[:head]], "last": [line(a) for a in acts[-tail:]]}


def time_steps(decoder: Decoder, frames: int, device, positions: int = 100) -> list[float]:
    """ms per frame of the real decode loop (step + async host copy, host one frame behind), EOS ignored,
    every slot busy and `positions` in."""
    q = decoder.talker.cfg.num_codebooks
    sink = HostFrames(frames + 1, q, device)
    x = torch.full((decoder.cache.batch, q), decoder.talker.cfg.stream_bos_id, dtype=torch.long, device=device)
    for slot in range(decoder.cache.batch):
        decoder.sampler.reset(slot, SamplingParams(seed=slot))
    decoder.cache.lengths.fill_(positions)
    for _ in range(5):
        x = decoder.step_fn(x)
    decoder.cache.lengths.fill_(positions)
    sync(device)
    stamps = []
    for t in range(frames):
        x = decoder.step_fn(x)
        sink.put(t, x[0])
        if t:
            sink.get(t - 1)
        stamps.append(time.perf_counter())
    sink.get(frames - 1)
    sync(device)
    stamps.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": statistics.median(s), "p90_ms": p90(s), "n": len(s)}


def first_audio(tts: TTS, runs: int = 20) -> dict:
    """Text in -> first PCM chunk on the host through `TTS.stream` itself (its prompt, prefill, steps queued one
    ahead, codec lane and first-chunk wait), the stream closed once the chunk is in: the median of `runs` warm
    runs after one untimed run. `steps`: the decode steps the stream had taken when its first chunk came, the one
    queued ahead not counted (counted through the decoder's step function); `ended_before_first_chunk`: the
    utterance ended before that chunk was due (the tiny random model on the CPU), so it came from the flush."""
    decoder = tts.decoder
    step, calls = decoder.step_fn, [0]

    def counted(frames):
        calls[0] += 1
        return step(frames)

    decoder.step_fn = counted
    samples = []
    try:
        for i in range(runs + 1):
            calls[0] = 0
            sync(tts.device)
            t0 = time.perf_counter()
            with tts.stream(SENTENCE, seed=1) as stream:
                next(stream, None)
                total = time.perf_counter() - t0
                ended = bool(stream.frames)  # an utterance ended (its frames are in the results) before the chunk
                queued = calls[0]
            if i:
                samples.append((1e3 * total, queued - 1, ended))
    finally:
        decoder.step_fn = step
    return {"total_ms": statistics.median(s[0] for s in samples), "steps": samples[0][1],
            "ended_before_first_chunk": samples[0][2], "runs": runs}


def prompt_ms(builder: PromptBuilder, runs: int = 20) -> float:
    """The median time to build the sentence's prompt (tokenizing it), which first audio includes."""
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        builder.tts(SENTENCE)
        samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def prefill_ms(decoder: Decoder, prompt, device, runs: int = 20) -> float:
    """The median of `runs` warm prefills of `prompt` into slot 0 (the prompt built already; one untimed first: its
    bucket's graph capture on CUDA)."""
    samples = []
    for i in range(runs + 1):
        sync(device)
        t0 = time.perf_counter()
        decoder.start(0, prompt, SamplingParams(seed=1))
        sync(device)
        if i:
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def prefill_clone(decoder: Decoder, builder: PromptBuilder, device, audio_frames: int = 320, runs: int = 20) -> dict:
    """`prefill_ms` of a voice-clone prompt of about 400 positions (a reference transcript, `audio_frames` random
    delayed reference frames, the sentence)."""
    from higgs_rt.fixtures.codec import delayed_frames

    cfg = decoder.talker.cfg
    codes = torch.randint(0, cfg.stream_bos_id, (audio_frames - cfg.num_codebooks + 1, cfg.num_codebooks),
                          generator=torch.Generator().manual_seed(0))
    prompt = builder.clone(SENTENCE, "A short reference sentence that the speaker read aloud for the recording.",
                           delayed_frames(codes, cfg.stream_bos_id))
    return {"positions": len(prompt), "audio_frames": prompt.audio_frames.shape[0],
            "median_ms": prefill_ms(decoder, prompt, device, runs), "runs": runs, "prompt": prompt}


def admit(decoder: Decoder, builder: PromptBuilder, device, prompts: int = 11, runs: int = 10) -> dict:
    """`prompts` sentence prompts into slots 0 .. prompts - 1: one `start` each against one `start_many` (one
    untimed run of each first), median ms; the slots are released after each run."""
    prompt = builder.tts(SENTENCE)
    starts = [(slot, prompt, SamplingParams(seed=slot), False) for slot in range(prompts)]

    def timed(fn) -> float:
        samples = []
        for i in range(runs + 1):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i:
                samples.append(1e3 * (time.perf_counter() - t0))
            for slot in range(prompts):
                decoder.release(slot)
        return statistics.median(samples)

    return {"prompts": prompts, "tokens_each": len(prompt),
            "one_by_one_ms": timed(lambda: [decoder.start(*s) for s in starts]),
            "start_many_ms": timed(lambda: decoder.start_many(starts)), "runs": runs}


def codec_chunk_ms(codec, device, chunk: int, iters: int = 20) -> float:
    """One streaming codec call in steady state: `chunk` delayed frames through every convolution's state."""
    lanes = StreamingCodec(codec, 1, graph_widths=(chunk,))  # graphed on CUDA, as the runtime's chunks are
    lanes.start(0)
    frames = torch.randint(0, codec.codebook_size, (1, chunk, codec.num_quantizers), device=device)
    for _ in range(3):
        lanes.push(frames)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        lanes.push(frames)
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / iters


def transformers_ms_per_frame(hf_cfg: dict, state: dict, prompt, frames: int, device, dtype) -> float:
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    config = HiggsAudioV2Config(**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    with torch.device(device):
        model = HiggsAudioV2ForConditionalGeneration(config).to(dtype)
    model.load_state_dict(state, strict=True, assign=True)  # the very tensors higgs-rt reads
    model.eval()
    ids = prompt.ids[None].to(device)
    kwargs = dict(max_new_tokens=frames, eos_token_id=None, do_sample=True, temperature=1.0, top_k=50, top_p=0.95)
    with torch.no_grad():
        model.generate(input_ids=ids, **dict(kwargs, max_new_tokens=3))
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, **kwargs)
        sync(device)
    n = out.shape[1]
    assert n == frames, f"transformers generated {n} frames, asked for {frames}"
    return 1e3 * (time.perf_counter() - t0) / n


COLD_CHILD = """
import json, sys
from higgs_rt import cli, timing
if sys.argv[1] == "warmup":  # speak as it would with TTS's warm-up utterance (the comparison)
    load = cli.load_tts
    cli.load_tts = lambda args, warmup=None: load(args, warmup=True)
code = cli.main(sys.argv[2:])
print(json.dumps(dict(timing.current().to_dict(), code=code)))
"""


def cold_start_model(work: Path, size: str) -> Path:
    """A random checkpoint in the released layouts (Boson's shards with the text head, the codec's model.pth),
    written once under `work`."""
    from higgs_rt.fixtures.codec import make_codec
    from higgs_rt.fixtures.talker import make_talker

    model = work / size
    if not (model / "done").exists():
        make_talker(model, size, layout="boson")
        make_codec(model / "audio_tokenizer", "full" if size == "full" else "tiny", layout="boson")
        (model / "done").touch()
    return model


def cold_start(model: Path, runs: int, device) -> dict:
    """`higgs-rt speak --verbose` in fresh processes, `runs` times as it is and `runs` times with TTS's warm-up
    utterance (which speak skips), alternating (so a machine's load drifts alike into both), after one untimed
    run that page-caches the weights. Per variant: import torch's time and the rest of the cold start to the first
    PCM chunk (medians), every run, and the stages of the median run."""
    out = Path(tempfile.mkdtemp(prefix="higgs-rt-cold-")) / "speech.wav"
    argv = ["speak", SENTENCE, "--model", str(model), "--out", str(out), "--seed", "1", "--max-frames", "40",
            "--compute", device.type, "--verbose"]
    samples = {"plain": [], "warmup": []}
    load_before = os.getloadavg()  # the machine's load: other work inflates these times
    order = ["plain"] + [v for _ in range(runs) for v in ("plain", "warmup")]
    for i, variant in enumerate(order):
        r = subprocess.run([sys.executable, "-c", COLD_CHILD, variant, *argv], capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"cold start run failed ({r.returncode}):\n{r.stderr[-3000:]}")
        t = json.loads(r.stdout.strip().splitlines()[-1])
        stages = {s["path"]: s["seconds"] for s in t["stages"] if s["seconds"] is not None}
        if i:  # the first run only fills the page cache
            samples[variant].append({"import_torch_s": stages["import torch"],
                                     "cold_start_s": t["final_s"] - t["import_torch_end_s"],
                                     "process_to_first_audio_s": t["final_s"], "stages": stages})
    result = {}
    for variant, runs_ in samples.items():
        median = sorted(runs_, key=lambda x: x["cold_start_s"])[(len(runs_) - 1) // 2]
        result[variant] = {
            "import_torch_s": statistics.median(x["import_torch_s"] for x in runs_),
            "cold_start_s": statistics.median(x["cold_start_s"] for x in runs_),
            "process_to_first_audio_s": statistics.median(x["process_to_first_audio_s"] for x in runs_),
            "runs": len(runs_), "model": str(model), "load_average_before_after": [load_before[0], os.getloadavg()[0]],
            "command": "higgs-rt " + " ".join(argv) + (" (with TTS's warm-up)" if variant == "warmup" else ""),
            "samples": [{k: v for k, v in x.items() if k != "stages"} for x in runs_],
            "median_run_stages_s": median["stages"]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--hf-frames", type=int, default=100, help="0 skips transformers")
    ap.add_argument("--tokenizer", type=Path, help="directory with tokenizer.json (default: rebuilt from llama-models)")
    ap.add_argument("--compile", default=None, help="torch.compile mode for the step (default: eager + CUDA graph)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cold-start-runs", type=int, default=5, help="fresh `higgs-rt speak` processes (0 skips)")
    ap.add_argument("--cold-start-model", type=Path, help="the checkpoint they load (default: a random one in the "
                                                          "released layouts under /tmp/higgs-rt-bench-cold)")
    ap.add_argument("--cold-start-only", action="store_true", help="measure the cold start only")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    size, dtype = ("full", torch.bfloat16) if cuda else ("tiny", torch.float32)
    tok_dir = args.tokenizer
    if tok_dir is None:
        from higgs_rt.fixtures.tokenizer import make_tokenizer

        tok_dir = make_tokenizer(Path("/tmp/higgs-rt-bench-tokenizer"))
    from higgs_rt.codec import load_codec
    from higgs_rt.fixtures.codec import make_codec

    result = run_info(device) | {"size": size, "dtype": str(dtype).removeprefix("torch.")}
    name = "cold_start" if args.cold_start_only else "frame_latency"
    out = args.out or ROOT / "benchmarks" / "results" / f"{name}_{'gpu' if cuda else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage, so a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=2) + "\n")

    if args.cold_start_runs:  # first: fresh processes with the device to themselves
        model = args.cold_start_model or cold_start_model(Path("/tmp/higgs-rt-bench-cold"), size)
        runs = cold_start(model, args.cold_start_runs, device)
        result["cold_start"] = runs["plain"]
        result["import_torch_s"] = result["cold_start"]["import_torch_s"]
        result["cold_start_s"] = result["cold_start"]["cold_start_s"]
        # what speak's choice to skip TTS's warm-up utterance gains (README "Cold start")
        result["cold_start_with_warmup"] = runs["warmup"]
        result["cold_start_with_warmup_s"] = result["cold_start_with_warmup"]["cold_start_s"]
        save()
        print(f"import torch {result['import_torch_s']:.2f} s, then {result['cold_start_s']:.2f} s to first audio "
              f"({result['cold_start_with_warmup_s']:.2f} s with the warm-up utterance; medians of "
              f"{args.cold_start_runs} fresh `higgs-rt speak` runs)")
    if args.cold_start_only:
        print(json.dumps(result, indent=2))
        return
    result["copy_bandwidth_GBs"] = copy_bandwidth(device)

    hf_cfg, state = random_state(size, device, dtype)
    state = {k: v.cpu() for k, v in state.items()}  # off the GPU, so the peak below is higgs-rt's alone
    cfg = TalkerConfig.from_dict(hf_cfg)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    talker = Talker.from_weights(cfg, map_weights(state, cfg, dtype, device))
    builder = PromptBuilder(tok_dir, cfg.audio_out_token_id)
    codec = load_codec(make_codec(Path("/tmp/higgs-rt-bench-codec") / size, size), device=device)

    t0 = time.perf_counter()
    decoder = Decoder(talker, batch=1, context=4096, compile=args.compile, cuda_graph=cuda)
    result["build_decoder_s"] = time.perf_counter() - t0
    result["compile"] = args.compile
    result["decode_kernels"] = talker.decode_kernels
    result["higgs_rt"] = summarize(time_steps(decoder, args.frames, device))
    result["b1_ms"] = result["higgs_rt"]["median_ms"]
    result["b1_ms_at_2000"] = summarize(time_steps(decoder, args.frames, device, positions=2000))["median_ms"]
    step_bytes = weight_bytes_per_step(cfg, torch.finfo(dtype).bits // 8)
    result["step_weight_GB"] = step_bytes / 1e9
    result["copy_GBs"] = result["copy_bandwidth_GBs"]
    result["achieved_GBs"] = step_bytes / 1e6 / result["b1_ms"]
    result["fraction_of_copy"] = result["achieved_GBs"] / result["copy_GBs"]
    if cuda:
        decoder.cache.lengths.fill_(100)  # as b1_ms (the run at 2000 left it there)
        result["step_profile"] = replay_profile(decoder.step_fn.graph)
        result["kernels_per_step"] = result["step_profile"]["activities"]
    save()
    sentence = builder.tts(SENTENCE)
    result["prefill_sentence"] = {"positions": len(sentence), "median_ms": prefill_ms(decoder, sentence, device),
                                  "runs": 20}  # the prompt built already
    tts = TTS(Model.from_parts(talker, codec, builder, context=4096), compile=args.compile, warmup=False)
    result["first_audio"] = fa = first_audio(tts)
    fa["prompt_ms"] = prompt_ms(builder)
    fa["prefill_ms"] = fa["prompt_ms"] + result["prefill_sentence"]["median_ms"]  # the prompt built, then prefilled
    fa["steps_ms"] = fa["steps"] * result["b1_ms"]
    fa["beyond_steps_ms"] = fa["total_ms"] - fa["prefill_ms"] - fa["steps_ms"]  # target <= 3
    del tts
    result["codec_chunk_ms"] = {"first": codec_chunk_ms(codec, device, StreamingDecoder(codec).first_chunk),
                                "later": codec_chunk_ms(codec, device, StreamingDecoder(codec).chunk)}
    fa["codec_ms"] = result["codec_chunk_ms"]["first"]  # inside beyond_steps_ms
    clone = prefill_clone(decoder, builder, device)
    result["prefill_clone"] = {k: v for k, v in clone.items() if k != "prompt"}
    if cuda:
        result["prefill_profile"] = {
            "sentence": kernel_profile(partial(decoder.start, 0, sentence, SamplingParams(seed=1))),
            "clone": kernel_profile(partial(decoder.start, 0, clone["prompt"], SamplingParams(seed=1)))}
    if cuda:
        result["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    del decoder

    if cuda:  # the plain torch step, graphed the same way: what the fused kernels replace
        with ops.references():
            plain = Decoder(talker, batch=1, context=4096, cuda_graph=True)
            result["b1_torch_step_ms"] = summarize(time_steps(plain, min(args.frames, 100), device))["median_ms"]
            result["kernels_per_torch_step"] = kernels_per_replay(plain.step_fn.graph)
        del plain
        save()

    for batch, positions in ((8, 100), (64, 500)):
        dec = Decoder(talker, batch=batch, context=4096, compile=args.compile, cuda_graph=cuda)
        stats = summarize(time_steps(dec, min(args.frames, 200), device, positions=positions))
        result[f"b{batch}_ms"] = stats["median_ms"]
        result[f"batch{batch}"] = dict(stats, positions=positions, frames_per_s=batch * 1e3 / stats["median_ms"])
        if cuda:
            dec.cache.lengths.fill_(positions)
            result[f"batch{batch}"]["step_profile"] = replay_profile(dec.step_fn.graph)
        if batch == 8:
            at_500 = summarize(time_steps(dec, min(args.frames, 200), device, positions=500))
            result["b8_ms_at_500"] = at_500["median_ms"]
        if batch == 64:
            result["admit_11"] = admit(dec, builder, device)
        del dec
        save()

    if args.hf_frames:
        state = {k: v.to(device) for k, v in state.items()}
        hf_ms = transformers_ms_per_frame(hf_cfg, state, builder.tts(SENTENCE), args.hf_frames, device, dtype)
        result["transformers_ms_per_frame"] = hf_ms
        result["speedup_vs_transformers"] = hf_ms / result["b1_ms"]
        save()
    keys = ("device", "b1_ms", "b8_ms", "b64_ms", "b1_ms_at_2000", "b8_ms_at_500", "kernels_per_step", "copy_GBs",
            "achieved_GBs", "fraction_of_copy", "b1_torch_step_ms", "kernels_per_torch_step",
            "transformers_ms_per_frame")
    for k in keys:
        if k in result:
            print(f"{k:>26}: {result[k]:.4g}" if isinstance(result[k], float) else f"{k:>26}: {result[k]}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
