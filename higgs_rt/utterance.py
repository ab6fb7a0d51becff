"""One request's utterance state machine, the same for one slot (`TTS.stream`) and many (`BatchEngine`).

A request's text is split into utterances that fit the frame budget (`Model.segments`: sentences, then clauses,
then words), or comes as a list of segments, one utterance each; a text session (`higgs_rt.session`) starts with
none and `add`s each segment as its text completes, so the same state machine carries the voice and the seeds
across what is spoken incrementally. `Speech` walks them in order:

    prompt = speech.start()          # the next utterance's prompt (None once all are done or stopped)
    ... prefill it, then per generated frame (host [Q]):
    if speech.push(frame): ...       # True: the utterance ended (all-EOS frame or max_frames)
    speech.stop()                    # barge-in: the running utterance ends here, no later one starts

Each utterance after the first is prompted with the previous one's text and generated codes as a reference turn,
so the voice carries over; with a cloned `voice`, every utterance uses that reference instead. The stats and the
delayed frames of every utterance (`results`) stay with the Speech, so they travel with the stream.

Whoever steps the slot owns the device and the codec; the Speech owns what the frames mean: where an utterance
ends (`ended_at`: the lane frame of its end, what the streaming codec's `end` takes) and what comes next.

The voice and max_frames are checked when the Speech is made (`check_room`): a cloned voice's reference
(transcript and frames) must leave room in the context for max_frames and a few words (MIN_TEXT_TOKENS); a
transcript that leaves none is a `TranscriptError` (the transcript's fault, not the text's: a server names
`ref_text`), saying how many tokens it takes and how many fit; a max_frames that leaves no room for one letter is a
`params.ParamError` of max_frames (a server names max_new_tokens), not the text's fault.
"""

from __future__ import annotations

import time

import torch

from .audio_in import TranscriptError
from .params import MIN_FRAMES, ParamError
from .prompt import Prompt, PromptError, check_budget, check_text
from .types import Generation, SamplingParams, StreamStats, SynthesisParams, Voice

MIN_TEXT_TOKENS = 16  # the room a cloned voice's reference must leave in the context for the text: a few words


class Speech:
    def __init__(self, model, text: str | list[str] | tuple[str, ...] | None, voice: Voice | None,
                 params: SynthesisParams, incremental: bool = False):
        """model: a `higgs_rt.model.Model` (its prompts, segments and context). text: one text (split to fit the
        frame budget) or a non-empty list of segments (spoken as given, one utterance each); incremental: none
        yet (text None), a text session `add`s them. Checked here."""
        if voice is not None and not isinstance(voice, Voice):
            raise TypeError(f"voice must be a Voice, a stored voice's name or None, got {type(voice).__name__}")
        self.model, self.voice, self.params = model, voice, params
        if incremental:
            self.segments: list[str] = []
        elif isinstance(text, (list, tuple)):
            if not text:
                raise PromptError("the list of segments is empty")
            self.segments = [check_text(s, f"segment {i}") for i, s in enumerate(text)]
        else:
            self.segments = model.segments(check_text(text), voice, params)
        self.check_room()  # before the text's own prompts (`check`): a max_frames no text fits is its own fault
        cfg = model.talker.cfg
        self.q, self.bos, self.eos = cfg.num_codebooks, cfg.stream_bos_id, cfg.stream_eos_id
        self.index = 0  # the utterance started by the next `start`
        self.results: list[Generation] = []
        self.stats = StreamStats()
        self.stopped = False
        self._reference = voice
        self._frames: list[torch.Tensor] | None = None  # the running utterance's frames
        self._started = 0.0

    def check_room(self) -> None:
        """The shortest utterance fits: the prompt of a one-letter text (with a cloned voice's reference, and then
        MIN_TEXT_TOKENS more: a few words) and max_frames leave room in the context. If they do not, a transcript
        that a shorter one would leave room is to blame: a TranscriptError saying how many tokens it takes and how
        many fit; else max_frames is, a ParamError (param max_frames) naming the most that fits."""
        voice, p, context = self.voice, self.params, self.model.context
        shortest = len(self.model.prompt("a", voice, p))  # the prompt of a one-letter utterance
        margin = 0 if voice is None else MIN_TEXT_TOKENS
        room = context - p.max_frames - shortest - margin
        if room >= 0:
            return
        if voice is not None:
            tokens = self.model.prompts.turn_tokens(voice.text, "reference transcript")
            if tokens + room >= 1:
                raise TranscriptError(f"the reference transcript takes {tokens} tokens: at most {tokens + room} fit "
                                      f"in the context of {context} positions beside the reference's "
                                      f"{voice.frames.shape[0]} audio frames, max_frames ({p.max_frames}) and a few "
                                      "words of text: shorten the transcript (or lower max_frames)")
        most = context - shortest - margin
        what = "one letter" if voice is None else "one letter and the reference"
        fix = f"use at most {most}" if most >= MIN_FRAMES else "use a shorter reference recording or a longer context"
        raise ParamError(f"max_frames ({p.max_frames}) leaves no room for any utterance: with its prompt ({shortest} "
                         f"tokens for {what}) it passes the context of {context} positions; {fix}", "max_frames")

    def check(self) -> "Speech":
        """Every utterance's prompt must fit the context with the longest reference it can be given (without a
        voice: the previous utterance's text and up to max_frames of its frames), so a request fails before its
        first audio has gone out, never after. Returns self."""
        for i, segment in enumerate(self.segments):
            self.check_segment(segment, self.segments[i - 1] if i else None)
        return self

    def check_segment(self, segment: str, previous: str | None) -> None:
        """An utterance's text fits the context with the longest reference it can be given (see `check`);
        previous: the text of the utterance before it (None: it is the first)."""
        p = self.params
        reference = self.voice
        if reference is None and previous is not None:
            longest = torch.zeros(min(p.max_frames, self.model.context), self.q, dtype=torch.long)
            reference = Voice(previous, longest)
        check_budget(len(self.model.prompt(segment, reference, p)), p.max_frames, self.model.context)

    def add(self, segment: str, checked: bool = False) -> None:
        """One more utterance at the end, checked: its text, and its prompt against the context (unless checked:
        the caller ran `check_segment` on it with the same previous segment, so its prompt is not built twice)."""
        segment = check_text(segment)
        if not checked:
            self.check_segment(segment, self.segments[-1] if self.segments else None)
        self.segments.append(segment)

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """No utterance runs and none is left to start."""
        return self._frames is None and (self.stopped or self.index >= len(self.segments))

    @property
    def running(self) -> bool:
        return self._frames is not None

    @property
    def last(self) -> bool:
        """The running (or just ended) utterance is the request's last one."""
        return self.stopped or self.index + (self._frames is not None) >= len(self.segments)

    @property
    def frames(self) -> int:
        """Frames of the running utterance so far, its all-BOS frame 0 included."""
        return 0 if self._frames is None else len(self._frames)

    def sampling(self) -> SamplingParams:
        """The running utterance's sampling parameters (its seed follows the utterance index)."""
        return self.params.sampling(self.index - 1)

    # ---- transitions -------------------------------------------------------------------------------------
    def start(self) -> Prompt | None:
        """Begin the next utterance: its prompt (checked against the context), or None when none is left."""
        if self._frames is not None:
            raise RuntimeError("start(): an utterance is still running")
        if self.stopped or self.index >= len(self.segments):
            return None
        prompt = self.model.prompt(self.segments[self.index], self._reference, self.params)
        check_budget(len(prompt), self.params.max_frames, self.model.context)
        self.index += 1
        self.stats.prompt_tokens += len(prompt)
        self._started = self._started or time.perf_counter()
        self._frames = [torch.full((self.q,), self.bos, dtype=torch.long)]
        return prompt

    def push(self, frame: torch.Tensor, eos: bool | None = None) -> bool:
        """The running utterance's next frame (host [Q]); True when it ended (all-EOS frame or max_frames).
        eos: whether the frame is all-EOS, when the caller has checked (a batch of frames at once)."""
        if self._frames is None:
            raise RuntimeError("push(): no utterance is running")
        self._frames.append(frame)
        finished = bool((frame == self.eos).all()) if eos is None else eos
        if finished or len(self._frames) >= self.params.max_frames:
            self._end(finished=finished)
            return True
        return False

    def stop(self) -> None:
        """End the request here: the running utterance keeps the frames it has; no later one starts."""
        if self._frames is not None:
            self._end(finished=False, stopped=True)
        self.stopped = self.stats.stopped = True

    def end(self) -> None:
        """`stop`, unless the request is done (a stream closed or dropped before its end)."""
        if not self.done:
            self.stop()

    def ended_at(self) -> int:
        """The last ended utterance's end as a codec lane frame: its all-EOS frame's index, or (cut short) the
        index right after its last frame."""
        result = self.results[-1]
        n = result.frames.shape[0]
        return n - 1 if result.finished else n

    def _end(self, finished: bool, stopped: bool = False) -> None:
        result = Generation(torch.stack(self._frames), finished=finished, stopped=stopped)
        self._frames = None
        self.results.append(result)
        self.stats.frames += result.frames.shape[0]
        self.stats.utterances += 1
        self.stats.truncated += not (finished or stopped)
        self.stats.synthesis_s = time.perf_counter() - self._started
        if self.voice is None and finished:
            self._reference = Voice(self.segments[self.index - 1], result.frames)
