"""The generation loop: prefill a slot, then one decode step (forward + sampling) per frame.

`Decoder` binds the shared Talker weights to one set of per-stream state (KV cache and sampler slots);
`Decoder.step` is the whole per-frame hot path and the unit that gets compiled or graphed. The host sees
frames only through asynchronous copies, one step behind the device, which is what streaming needs and all
that stopping at the first all-EOS frame needs.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import Tensor

from . import ops
from .cuda_graph import capture_graph
from .params import CONTEXT, MAX_FRAMES
from .prefill import BucketedPrefill
from .prompt import Prompt, check_budget
from .sampling import FrameSampler, SamplingParams
from .talker import Talker
from .torch_compat import compile_modes, use_short_operator_text
from .types import Generation

DEFAULT_CONTEXT = CONTEXT
DEFAULT_MAX_FRAMES = MAX_FRAMES


def check_compile(mode) -> None:
    """A decode step's compile setting: None (eager) or a torch.compile mode, else a ValueError naming them."""
    if mode is None:
        return
    modes = compile_modes()
    if not isinstance(mode, str) or mode not in modes:
        raise ValueError(f"compile must be None (eager) or a torch.compile mode ({', '.join(modes)}), got {mode!r}")


def bucket_sizes(batch: int) -> list[int]:
    """The row counts a decoder of `batch` slots steps: powers of two below it, and `batch` itself."""
    sizes = [1 << i for i in range(batch.bit_length()) if 1 << i < batch]
    return sizes + [batch]


class Decoder:
    """Talker weights bound to `batch` slots of per-stream state.

    A step runs the first n slots for n a bucket size (`bucket_sizes`: 1, 2, 4, ... batch): `steps[n](frames[:n])`,
    so a server whose active slots are the lowest ones steps only as many rows as the smallest bucket that holds
    them. The step over n < batch slots reads and writes the full KV cache tensors (k[i][:n] is contiguous),
    lengths[:n] and the sampler's rows [:n]; rows n.. are untouched.

    compile: a torch.compile mode for the step (e.g. "max-autotune-no-cudagraphs"), or None for eager.
    cuda_graph: capture the whole step (forward, sampling, state machine) as one CUDA graph per bucket, replayed per
    frame; and the prefill as CUDA graphs per prompt bucket (`higgs_rt.prefill`: on CUDA prompts are padded to
    their bucket with or without graphs, so eager and graphed decoders give the same codes).
    compiled: exported artifacts (`higgs_rt.compiled`): their prefill, and their step for this batch size (the
    full bucket; smaller buckets run the eager step) in place of `compile` (a CUDA graph still captures it).
    ignore_eos: `start(..., ignore_eos=True)` may ask that a slot never sample its EOS code (utterances of
    known length, for benchmarks); the step then masks that logit per row.
    """

    def __init__(self, talker: Talker, batch: int = 1, context: int = DEFAULT_CONTEXT, ras_window: int = 7,
                 compile: str | None = None, cuda_graph: bool = False, compiled=None, ignore_eos: bool = False):
        if batch < 1:
            raise ValueError(f"a decoder needs batch >= 1, got {batch}")
        check_compile(compile)
        self.talker, self.batch = talker, batch
        self.cache = talker.new_cache(batch, context)
        self.prefill_forwards = 0  # prefill forwards run by `start_many` (a batched one counts once)
        cfg = talker.cfg
        self.sampler = FrameSampler(batch, cfg.num_codebooks, cfg.num_codes, talker.device, ras_window)
        # benchmarks only: rows whose EOS code is never sampled (an exported step has no such rows)
        self.suppress_eos = torch.zeros(batch, dtype=torch.bool, device=talker.device) if ignore_eos else None
        if compiled is not None:
            self.prefill_fn = compiled.prefill
        elif talker.device.type == "cuda":  # padded the same way graphed or not: the same codes either way
            self.prefill_fn = BucketedPrefill(talker, self.cache, graphs=cuda_graph)
        else:
            self.prefill_fn = talker.prefill
        exported = None if compiled is None or ignore_eos else compiled.step_for(self)
        if compile:
            use_short_operator_text()  # torch 2.11's Inductor would format the fused ops' inputs without end
        # held weakly: a Decoder holding its own bound step would be a reference cycle, and `del decoder` would
        # leave its cache (up to tens of GB) to the garbage collector (torch.compile's wrapper keeps it strongly)
        eager = torch.compile(self.step, mode=compile, fullgraph=True) if compile else _weak_method(self.step)
        if cuda_graph and talker.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        self.steps: dict[int, Callable[[Tensor], Tensor]] = {}
        for n in bucket_sizes(batch):
            step = exported if exported is not None and n == batch else eager
            self.steps[n] = self._graphed(step, eager, n, compiled) if cuda_graph else step
        self.step_fn = self.steps[batch]  # the step of every slot

    def _graphed(self, step, eager, n: int, compiled) -> "GraphedStep":
        """The step in a CUDA graph; an exported step that fails to run or capture gives way to the eager one."""
        if not getattr(step, "exported", False):
            return GraphedStep(step, self, n)
        try:
            return GraphedStep(step, self, n)
        except Exception as e:
            compiled.warn(f"its decode step failed in a CUDA graph: {type(e).__name__}: {e}")
            return GraphedStep(eager, self, n)

    def bucket(self, rows: int) -> int:
        """The smallest bucket size holding `rows` slots (slots 0 .. rows - 1)."""
        for n in self.steps:
            if n >= rows:
                return n
        raise ValueError(f"{rows} rows exceed the decoder's {self.batch} slots")

    @property
    def context(self) -> int:
        return self.cache.max_len

    @property
    def uses_exported_step(self) -> bool:
        return bool(getattr(getattr(self.step_fn, "step", self.step_fn), "exported", False))

    def start(self, slot: int, prompt: Prompt, params: SamplingParams, ignore_eos: bool = False) -> Tensor:
        """Prefill `slot` with a prompt and reset its sampling state; returns frame 0 [Q] (all stream-BOS)."""
        return self.start_many([(slot, prompt, params, ignore_eos)])[0]

    @torch.no_grad()
    def start_many(self, starts: list[tuple[int, Prompt, SamplingParams, bool]],
                   groups: list | None = None) -> list[Tensor]:
        """`start` for several slots, (slot, prompt, params, ignore_eos) each: with the bucketed prefill, the
        prompts of one bucket share batched forwards (`BucketedPrefill.many`); returns each slot's frame 0.
        groups: each prompt's `prefill_group`, when the caller has it already (None: computed here)."""
        if self.suppress_eos is None and any(ignore for *_, ignore in starts):
            raise ValueError("ignore_eos needs a decoder built with ignore_eos=True")
        many = getattr(self.prefill_fn, "many", None)
        if many is not None:
            self.prefill_forwards += many(self.cache, [(slot, prompt.ids, prompt.audio_frames)
                                                       for slot, prompt, _, _ in starts], groups)
        else:
            for slot, prompt, _, _ in starts:
                self.prefill_fn(self.cache, slot, prompt.ids, prompt.audio_frames)
                self.prefill_forwards += 1
        frames = []
        for slot, prompt, params, ignore_eos in starts:
            if self.suppress_eos is not None:
                self.suppress_eos[slot].fill_(ignore_eos)
            frames.append(self.sampler.reset(slot, params, prompt.audio_frames))
        return frames

    def prefill_group(self, prompt: Prompt) -> tuple[object, int] | None:
        """(the forward group a prompt joins, prompts per forward) when `start_many` prefills it in batched
        forwards of a fixed size, else None: a group's seats not taken by a prompt cost the same forward."""
        group = getattr(self.prefill_fn, "group", None)
        return None if group is None else group(prompt.ids)

    @torch.no_grad()
    def step(self, frames: Tensor) -> Tensor:
        """Frames [n, Q] at slots 0..n-1's current positions -> their next frames [n, Q] (n <= batch; the other
        slots are untouched). Finished or idle slots (sampler.done) emit EOS and do not advance. With the fused
        kernels (`Talker.decode_kernels`) the forward and the sampler are about 150 kernels for any batch up to 64;
        otherwise the plain torch step."""
        n = frames.shape[0]
        sampler = self.sampler.rows(n)
        if self.talker.decode_kernels and n <= ops.GEMV_MAX_BATCH:
            return sampler.step(self._no_eos(self.talker.fused_step(self.cache, frames)), self.cache.lengths[:n])
        return sampler(self._no_eos(self.talker.step(self.cache, frames, advance=~sampler.done)))

    def _no_eos(self, logits: Tensor) -> Tensor:
        if self.suppress_eos is not None:
            eos = self.talker.cfg.stream_eos_id
            logits[:, :, eos].masked_fill_(self.suppress_eos[: logits.shape[0], None], float("-inf"))
        return logits

    def release(self, slot: int) -> None:
        """Free a slot: it idles (EOS, no KV growth) until the next `start`."""
        self.sampler.done[slot].fill_(True)  # fills: no pageable copy, no wait for the stream
        self.cache.lengths[slot].fill_(0)


def _weak_method(method: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    ref = weakref.WeakMethod(method)
    return lambda frames: ref()(frames)


class GraphedStep:
    """One CUDA graph of the whole decode step; a call copies the frames in and replays it.

    Captured right after the decoder is built: the warm-up steps only touch state that `start` resets.
    The returned tensor is the graph's static output, overwritten by the next replay.
    """

    def __init__(self, step: Callable[[Tensor], Tensor], decoder: Decoder, rows: int | None = None, warmup: int = 3):
        self.step = step
        cfg = decoder.talker.cfg
        self.frames = torch.full((rows or decoder.cache.batch, cfg.num_codebooks), cfg.stream_bos_id, dtype=torch.long,
                                 device=decoder.talker.device)
        self.graph, self.out = capture_graph(lambda: step(self.frames), warmup)
        decoder.cache.lengths.zero_()

    def __call__(self, frames: Tensor) -> Tensor:
        self.frames.copy_(frames)
        self.graph.replay()
        return self.out


class HostFrames:
    """Frames copied to (pinned) host memory without blocking; `get(i)` waits for frame i only.

    keep_device: also keep a device copy of each frame (`device(i)`, made before the host copy: so once `get(i)`
    returned it is complete), for a consumer on the device (the codec) while the step's output buffer is reused."""

    def __init__(self, n: int, q: int, device: torch.device, keep_device: bool = False):
        cuda = device.type == "cuda"
        self.frames = torch.empty((n, q), dtype=torch.long, pin_memory=cuda)
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.on_device: list[Tensor | None] | None = [None] * n if keep_device else None

    def put(self, i: int, frame: Tensor) -> None:
        if self.on_device is not None:
            self.on_device[i] = frame.clone()
        self.frames[i].copy_(frame, non_blocking=True)
        if self.events:
            self.events[i % 2].record()

    def device(self, i: int) -> Tensor:
        """Frame i on the device (keep_device)."""
        return self.on_device[i]

    def get(self, i: int) -> Tensor:
        if self.events:
            self.events[i % 2].synchronize()
        return self.frames[i]


def stream_frames(decoder: Decoder, prompt: Prompt, params: SamplingParams | None = None,
                  max_frames: int = DEFAULT_MAX_FRAMES, slot: int = 0,
                  should_stop: Callable[[], bool] | None = None, result: Generation | None = None):
    """Generate one utterance in `slot`, yielding each frame [Q] (host, int64) as soon as it is ready.

    Batch 1 is the common case; other slots keep their state. should_stop() is polled once per frame and a
    True ends generation (barge-in). `result`, if given, receives the frames and how the utterance ended.
    """
    params = (params or SamplingParams()).validate()
    check_budget(len(prompt), max_frames, decoder.context)
    q, eos = decoder.talker.cfg.num_codebooks, decoder.talker.cfg.stream_eos_id
    sink = HostFrames(max_frames, q, decoder.talker.device)
    frames = torch.full((decoder.cache.batch, q), eos, dtype=torch.long, device=decoder.talker.device)
    frames[slot] = decoder.start(slot, prompt, params)
    sink.put(0, frames[slot])
    result = result if result is not None else Generation(sink.frames)
    n = max_frames
    for t in range(1, max_frames + 1):
        if t < max_frames:  # queue step t before waiting for frame t - 1: the device never idles on the host
            frames = decoder.step_fn(frames)
            sink.put(t, frames[slot])
        prev = sink.get(t - 1)
        result.frames = sink.frames[:t]
        yield prev
        if bool((prev == eos).all()):
            result.finished, n = True, t
            break
        if should_stop is not None and should_stop():
            result.stopped, n = True, t
            break
    result.frames = sink.frames[:n].clone()


def generate(decoder: Decoder, prompt: Prompt, params: SamplingParams | None = None,
             max_frames: int = DEFAULT_MAX_FRAMES, slot: int = 0,
             on_frame: Callable[[int, Tensor], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> Generation:
    """Generate one utterance and return all its frames; on_frame(i, frame) sees each frame as it comes."""
    result = Generation(torch.empty(0))
    for i, frame in enumerate(stream_frames(decoder, prompt, params, max_frames, slot, should_stop, result)):
        if on_frame is not None:
            on_frame(i, frame)
    return result
