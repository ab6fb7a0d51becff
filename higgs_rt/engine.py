"""The embedding API: `TTS`, loaded once, streams speech for text (whisper.cpp style).

Weights (Talker, codec, tokenizer) live in the engine; each call's state (KV cache slot, sampler state,
streaming decoder) is apart and reset per utterance. A call is a params struct plus callbacks:

    tts = TTS("path/to/model", codec="path/to/codec")
    for pcm in tts.stream("Hello there.", seed=1):   # float32 chunks at tts.sample_rate
        ...
    tts.stop()                                        # from any thread: ends the stream within one frame

Long text is split into utterances that fit the frame budget: at sentences, then clauses, then words
(`higgs_rt.text_split`). Each utterance after the first is prompted with the previous one's text and generated
codes as a reference turn, so the voice carries over; with a cloned `voice`, every utterance uses that
reference instead.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .generate import DEFAULT_CONTEXT, Decoder, Generation, stream_frames
from .prompt import Prompt, PromptBuilder, check_text
from .params import SynthesisParams
from .talker import Talker
from .text_split import split_text

FRAMES_PER_CHAR = 1.8  # speech runs near 14 characters a second; 25 frames a second


@dataclass
class Voice:
    """A reference voice: its transcript and its delayed frames [N, Q] (BOS and EOS columns included)."""

    text: str
    frames: torch.Tensor


@dataclass
class StreamStats:
    """What one call measured. RTF = synthesis time / audio duration (below 1 is faster than real time)."""

    first_audio_s: float | None = None
    synthesis_s: float = 0.0
    audio_s: float = 0.0
    frames: int = 0
    utterances: int = 0
    truncated: int = 0  # utterances that hit max_frames without EOS
    stopped: bool = False
    underruns: int = 0

    @property
    def rtf(self) -> float:
        return self.synthesis_s / self.audio_s if self.audio_s else float("inf")

    @property
    def ms_per_frame(self) -> float:
        return 1e3 * self.synthesis_s / self.frames if self.frames else float("nan")

    def summary(self) -> str:
        first = "n/a" if self.first_audio_s is None else f"{1e3 * self.first_audio_s:.0f} ms"
        return (f"first audio {first}, RTF {self.rtf:.3f} (synthesis {self.synthesis_s:.2f} s / audio "
                f"{self.audio_s:.2f} s), {self.ms_per_frame:.1f} ms/frame, {self.underruns} underruns")


class Utterances:
    """One call's text as utterances that fit the frame budget, prompted in order. After `done(i, result)`,
    utterance i + 1 is prompted with utterance i's text and codes as a reference turn, so the voice carries
    over; a cloned voice leads every utterance instead. Shared by `TTS` and the batch engine."""

    def __init__(self, tts: "TTS", text: str, voice: Voice | None, p: SynthesisParams):
        self.segments = tts._segments(text, voice, p)
        self._tts, self._voice, self._reference, self._params = tts, voice, voice, p

    def __len__(self) -> int:
        return len(self.segments)

    def prompt(self, i: int) -> Prompt:
        return self._tts._prompt(self.segments[i], self._reference, self._params)

    def done(self, i: int, result: Generation) -> None:
        if self._voice is None and result.finished:
            self._reference = Voice(self.segments[i], result.frames)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TTS:
    def __init__(self, model: str | Path | None = None, codec: str | Path | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, context: int = DEFAULT_CONTEXT,
                 first_chunk: int | None = None, chunk: int | None = None,
                 progress: bool = False, voices_dir: str | Path | None = None, compile: str | None = None,
                 warmup: bool | None = None, compiled: str | Path | bool | None = None):
        """compiled: a directory of `higgs-rt export` artifacts (None: MODEL/compiled if present; False: none)."""
        from .codec import load_codec, resolve_codec_dir
        from .compiled import load_compiled
        from .hub import resolve_model_dir

        self.device = torch.device(device or default_device())
        self.dtype = _dtype(dtype, self.device)
        model_dir = resolve_model_dir(model, progress=progress)
        self.talker = Talker.from_pretrained(model_dir, dtype=self.dtype, device=self.device, max_positions=context,
                                             progress=progress)
        self.codec_dir = resolve_codec_dir(codec, model_dir)  # --codec, MODEL/audio_tokenizer, then elsewhere
        self.codec = load_codec(self.codec_dir, device=self.device)
        self.voices_dir = voices_dir
        self._voice_library = None  # made (and the codec's encoder loaded) only when a voice is cloned
        if self.codec.num_quantizers != self.talker.cfg.num_codebooks or \
                self.codec.codebook_size != self.talker.cfg.num_codes:
            raise ValueError(f"codec ({self.codec.num_quantizers} x {self.codec.codebook_size} codes) does not match "
                             f"the model ({self.talker.cfg.num_codebooks} x {self.talker.cfg.num_codes} codes)")
        self.prompts = PromptBuilder(model_dir, self.talker.cfg.audio_out_token_id)
        self.compiled = load_compiled(compiled, model_dir, self.codec_dir, self.talker, self.codec, context)
        self.decoder = Decoder(self.talker, batch=1, context=context, compile=compile,
                               cuda_graph=self.device.type == "cuda", compiled=self.compiled)
        self.chunking = {k: v for k, v in dict(first_chunk=first_chunk, chunk=chunk).items() if v is not None}
        self.last_stats = StreamStats()
        self.last_frames: list[torch.Tensor] = []  # the last call's delayed frames, one tensor per utterance
        self._busy = threading.Lock()
        self._stop = threading.Event()
        self._player = None
        if self.device.type == "cuda" if warmup is None else warmup:
            self.warmup()

    def warmup(self) -> None:
        """One short utterance end to end, so kernels, autotuning and allocators are ready before the first call."""
        for _ in self.stream("Warm up.", seed=0, max_frames=40):
            pass

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    # ---- control --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the current stream (from any thread): generation stops within one frame, playback at once."""
        self._stop.set()
        player = self._player
        if player is not None:
            player.stop()

    # ---- cloned voices (higgs_rt.voices) -----------------------------------------------------------------------
    @property
    def voice_library(self):
        if self._voice_library is None:
            from .voices import VoiceLibrary, VoiceStore

            self._voice_library = VoiceLibrary(self.codec_dir, self.device, VoiceStore(self.voices_dir))
        return self._voice_library

    def add_voice(self, name: str, audio, text: str, sample_rate: int | None = None) -> Voice:
        """Encode a reference recording (path, or array + sample_rate) and its transcript; keep it as `name`."""
        self.voice_library.add(name, audio, text, sample_rate)
        return self.voice_library.voice(name)

    def voices(self) -> list[str]:
        return self.voice_library.names()

    def remove_voice(self, name: str) -> None:
        self.voice_library.remove(name)

    def clone_voice(self, audio, text: str, sample_rate: int | None = None) -> Voice:
        """A one-off reference (not named); its codes are cached by audio hash and codec."""
        return self.voice_library.reference(audio, text, sample_rate)

    def resolve_voice(self, voice: Voice | str | None) -> Voice | None:
        """A stored voice's name -> its `Voice`; a `Voice` or None as it is."""
        return self.voice_library.voice(voice) if isinstance(voice, str) else voice

    # ---- synthesis ------------------------------------------------------------------------------------------
    def stream(self, text: str, *, voice: Voice | str | None = None,
               on_chunk: Callable[[np.ndarray], None] | None = None, abort: Callable[[], bool] | None = None,
               **params) -> Iterator[np.ndarray]:
        """Yield float32 PCM chunks as they are decoded. Params: the fields of SynthesisParams; `voice` is a
        `Voice`, a stored voice's name (see `add_voice`) or None (the model's own voice)."""
        p = SynthesisParams.create(**params)
        text = check_text(text)
        voice = self.resolve_voice(voice)
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this TTS engine is already streaming: one stream at a time per engine")
        try:
            self._stop.clear()
            yield from self._run(text, voice, p, on_chunk, abort)
        finally:
            self._busy.release()

    def synthesize(self, text: str, *, voice: Voice | str | None = None, **params) -> np.ndarray:
        """The whole utterance as one float32 array at sample_rate."""
        chunks = list(self.stream(text, voice=voice, **params))
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    def speak(self, text: str, *, voice: Voice | str | None = None, device: int | str | None = None,
              on_chunk: Callable[[np.ndarray], None] | None = None, **params) -> StreamStats:
        """Play the speech on an output device as it is generated; returns the call's stats."""
        from .audio_out import AudioPlayer

        with AudioPlayer(device=device, samplerate=self.sample_rate) as player:
            self._player = player

            def play(chunk: np.ndarray) -> None:
                player.write(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)

            try:
                for _ in self.stream(text, voice=voice, on_chunk=play, **params):
                    pass
                player.stop() if self.last_stats.stopped else player.finish()
            except BaseException:  # Ctrl-C or an error: silence now, then let it propagate
                player.stop()
                raise
            finally:
                self._player = None
                self.last_stats.underruns = player.underruns
        return self.last_stats

    # ---- the loop --------------------------------------------------------------------------------------------
    def _prompt(self, text: str, voice: Voice | None, p: SynthesisParams) -> Prompt:
        if voice is None:
            return self.prompts.tts(text, scene=p.scene)
        return self.prompts.clone(text, voice.text, voice.frames, scene=p.scene)

    def _segments(self, text: str, voice: Voice | None, p: SynthesisParams) -> list[str]:
        """Split so each utterance's expected frames fit max_frames and the context."""
        reference = 0 if voice is None else voice.frames.shape[0]
        budget = min(p.max_frames, self.decoder.context - reference - 256 - p.max_frames // 2)
        max_chars = max(40, int(0.8 * budget / FRAMES_PER_CHAR))
        return split_text(text, max_chars)

    def _run(self, text, voice, p, on_chunk, abort) -> Iterator[np.ndarray]:
        from .codec import StreamingDecoder

        stats = self.last_stats = StreamStats()
        self.last_frames = []
        start = time.perf_counter()
        stopped = lambda: self._stop.is_set() or (abort is not None and abort())  # noqa: E731
        lane = CodecLane(self.device)
        plan = Utterances(self, text, voice, p)
        for i in range(len(plan)):
            if stopped():  # barge-in between utterances: the next one is not even prefilled
                stats.stopped = True
                break
            prompt = plan.prompt(i)
            codec_stream = StreamingDecoder(self.codec, **self.chunking)
            result = Generation(torch.empty(0))
            for frame in stream_frames(self.decoder, prompt, p.sampling(i), p.max_frames, should_stop=stopped,
                                       result=result):
                if self._stop.is_set():  # barge-in: no more codec work either; the loop ends after this frame
                    continue
                lane.submit(codec_stream.push, frame[None])
                yield from self._emit(lane.ready(), stats, start, on_chunk)
            stats.frames += result.frames.shape[0]
            self.last_frames.append(result.frames)
            stats.utterances += 1
            stats.truncated += not (result.finished or result.stopped)
            if result.stopped:
                stats.stopped = True
                break
            lane.submit(codec_stream.flush)
            yield from self._emit(lane.ready(wait=True), stats, start, on_chunk)
            plan.done(i, result)
        stats.synthesis_s = time.perf_counter() - start

    def _emit(self, chunks: Iterator[np.ndarray], stats: StreamStats, start: float, on_chunk) -> Iterator[np.ndarray]:
        for chunk in chunks:
            if stats.first_audio_s is None:
                stats.first_audio_s = time.perf_counter() - start
            stats.audio_s += chunk.shape[0] / self.sample_rate
            if on_chunk is not None:
                on_chunk(chunk)
            yield chunk


class CodecLane:
    """Code2Wav beside the Talker: on CUDA its kernels run on their own stream and its PCM reaches the host
    through asynchronous copies, polled once per frame, so codec chunks never stall the decode loop."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: deque[tuple[torch.cuda.Event | None, torch.Tensor]] = deque()

    def submit(self, decode: Callable[..., torch.Tensor], *args) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            pcm = decode(*args).detach()
            if pcm.numel() == 0:
                return
            if self.stream is None:
                self.pending.append((None, pcm.float()))
                return
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(pcm, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            self.pending.append((done, host))

    def ready(self, wait: bool = False) -> Iterator[np.ndarray]:
        """Chunks whose copy has landed, in order; with wait, all of them."""
        while self.pending:
            done, host = self.pending[0]
            if done is not None:
                if not (wait or done.query()):
                    return
                done.synchronize()
            self.pending.popleft()
            yield host.numpy()


def _dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {', '.join(names)}, got {dtype!r}")
    return names[dtype]
