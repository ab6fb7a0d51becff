"""`Model`: everything loaded once and shared by every stream: the Talker's weights, the codec, the prompt builder
and the exported artifacts, with the context they were built for. It holds no per-stream state; decoders (KV
cache and sampler slots, `higgs_rt.generate.Decoder`) are made from it by whoever steps streams: `TTS` one slot,
`BatchEngine` many.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import timing
from .config import ConfigError
from .generate import DEFAULT_CONTEXT, Decoder
from .params import check_context
from .prompt import Prompt, PromptBuilder
from .talker import Talker
from .text_split import split_text
from .types import SynthesisParams, Voice

FRAMES_PER_CHAR = 1.8  # speech runs near 14 characters a second; 25 frames a second


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The compute device (None: CUDA if available, else the CPU); a one-line ValueError for a device this machine
    or higgs-rt cannot use (a malformed name, CUDA without a GPU or a CUDA build of torch, a GPU index past the
    last, a device type other than cpu or cuda)."""
    if device is None:
        return torch.device(default_device())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: higgs-rt runs on 'cpu' or 'cuda'")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {device!r}: {why} (use 'cpu')")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}  # what the kernels compute in (`ops.FLOAT_DTYPES`)


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """The weights' dtype (None: bf16 on CUDA, fp32 on the CPU): a name in DTYPES or one of its torch dtypes."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be torch.float32, torch.bfloat16, torch.float16 or one of {', '.join(DTYPES)}, "
                     f"got {dtype!r}")


def _check_token_ids(prompts: PromptBuilder, cfg, config_file: Path) -> None:
    """The prompts' token ids must be rows of the model's embedding, and its audio ids none of the special tokens
    prompts use as text: else an IndexError, or a prompt whose audio positions have no frames, mid-synthesis."""
    name, top = max(prompts.special.items(), key=lambda item: item[1])
    if top >= cfg.vocab_size:
        raise ConfigError(f"{config_file}: vocab_size {cfg.vocab_size} does not hold the tokenizer's {name} ({top}): "
                          "tokenizer and model do not belong together")
    if cfg.audio_delay_token_id is not None:
        for name, token in prompts.special.items():
            if token == cfg.audio_delay_token_id and name != "<|AUDIO_OUT|>":
                raise ConfigError(f"{config_file}: audio_delay_token_id {token} is the tokenizer's {name}, which "
                                  "prompts use as text, not audio")


class Model:
    """The loaded model (see the module docstring). Attributes are set once here and never changed.

    compiled: a directory of `higgs-rt export` artifacts (None: MODEL/compiled if present; False: none).
    """

    def __init__(self, model: str | Path | None = None, codec: str | Path | None = None, device: str | None = None,
                 dtype: torch.dtype | str | None = None, context: int = DEFAULT_CONTEXT, progress: bool = False,
                 compiled: str | Path | bool | None = None):
        from .codec import load_codec, resolve_codec_dir
        from .compiled import load_compiled
        from .hub import resolve_model_dir

        self.context = check_context(context)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cuda":  # made now, so that the weights' stage times their copies alone
            with timing.stage("CUDA context"):
                torch.zeros(1, device=self.device)
        with timing.stage("model directory") as s:
            self.model_dir = resolve_model_dir(model, progress=progress)
            s.detail = str(self.model_dir)
        with timing.stage("talker weights"):  # detail: `weights.DeviceWriter.summary`
            self.talker = Talker.from_pretrained(self.model_dir, dtype=self.dtype, device=self.device,
                                                 max_positions=context, progress=progress)
        with timing.stage("codec") as s:
            self.codec_dir = resolve_codec_dir(codec, self.model_dir)  # --codec, MODEL/audio_tokenizer, elsewhere
            self.codec = load_codec(self.codec_dir, device=self.device)
            s.detail = f"{self.codec_dir}, {sum(p.numel() for p in self.codec.parameters()) / 1e6:.1f} M parameters"
        if self.codec.num_quantizers != self.talker.cfg.num_codebooks or \
                self.codec.codebook_size != self.talker.cfg.num_codes:
            raise ConfigError(f"{self.codec_dir / 'config.json'}: the codec's {self.codec.num_quantizers} x "
                              f"{self.codec.codebook_size} codes do not match the {self.talker.cfg.num_codebooks} x "
                              f"{self.talker.cfg.num_codes} codes of the model's {self.model_dir / 'config.json'}")
        with timing.stage("tokenizer (prompt builder)") as s:
            self.prompts = PromptBuilder(self.model_dir, self.talker.cfg.audio_out_token_id)
            _check_token_ids(self.prompts, self.talker.cfg, self.model_dir / "config.json")
            s.detail = self.prompts.encoder.how
        with timing.stage("compiled artifacts") as s:
            self.compiled = load_compiled(compiled, self.model_dir, self.codec_dir, self.talker, self.codec, context)
            s.detail = "none: eager" if self.compiled is None else str(self.compiled.directory)

    @classmethod
    def from_parts(cls, talker: Talker, codec, prompts: PromptBuilder, context: int = DEFAULT_CONTEXT,
                   codec_dir: str | Path | None = None) -> "Model":
        """A model around parts already built in memory (benchmarks and tests on random weights), with no
        checkpoint directory and no exported artifacts; codec_dir: where cloning finds the codec's encoder."""
        if check_context(context) > talker.max_positions:
            raise ValueError(f"context {context} is longer than the talker's {talker.max_positions} positions")
        model = cls.__new__(cls)
        model.device, model.dtype, model.context = talker.device, talker.dtype, context
        model.model_dir, model.codec_dir = None, None if codec_dir is None else Path(codec_dir)
        model.talker, model.codec, model.prompts, model.compiled = talker, codec, prompts, None
        return model

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def decoder(self, slots: int = 1, compile: str | None = None, cuda_graph: bool | None = None,
                ignore_eos: bool = False) -> Decoder:
        """Per-stream state for `slots` streams (cuda_graph None: on for CUDA; ignore_eos: `Decoder`'s)."""
        graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        return Decoder(self.talker, batch=slots, context=self.context, compile=compile, cuda_graph=graph,
                       compiled=self.compiled, ignore_eos=ignore_eos)

    def prompt(self, text: str, voice: Voice | None, p: SynthesisParams) -> Prompt:
        if voice is None:
            return self.prompts.tts(text, scene=p.scene)
        return self.prompts.clone(text, voice.text, voice.frames, scene=p.scene)

    def max_chars(self, voice: Voice | None, p: SynthesisParams) -> int:
        """The longest utterance, in characters, whose expected frames fit max_frames and the context."""
        reference = 0 if voice is None else voice.frames.shape[0]
        budget = min(p.max_frames, self.context - reference - 256 - p.max_frames // 2)
        return max(40, int(0.8 * budget / FRAMES_PER_CHAR))

    def segments(self, text: str, voice: Voice | None, p: SynthesisParams) -> list[str]:
        """The text split so each utterance's expected frames fit max_frames and the context."""
        return split_text(text, self.max_chars(voice, p))
