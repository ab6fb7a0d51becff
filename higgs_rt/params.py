"""One definition of every synthesis parameter: name, type, default, bounds and help, in `PARAMS`.

From that table come the checks of the Python API (`SamplingParams.validate`, `SynthesisParams.create`), the
`speak` options of the CLI (`add_cli_options`) and the checks of the HTTP request fields (`check_api_field`), so
a bound lives in one place. The bounds are what the engine can hold: finite floats, integers that fit its int64
(or int32) tensors, a frame budget a context can take, text the prompt builder takes. A leaf module: it imports
nothing from higgs_rt at import time (a text parameter's check is the prompt builder's, imported when one is given).

A refused value is a `ParamError` (a ValueError) carrying the parameter's name in the table, raised by the checks
here and by the engine's own (a max_frames that leaves the context no room): a server names the field at fault
from it (`api_name`: max_frames is max_new_tokens), never from the message's words.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields

RAS_WINDOW = 7  # the engine's repetition-aware-sampling window; a request turns RAS on (this window) or off (0)
MAX_FRAMES = 1024  # frames per utterance by default, about 40 s
MIN_FRAMES = 9  # the delay pattern alone takes 8 frames after the leading BOS frame
CONTEXT = 4096  # KV cache positions per slot by default (prompt + frames): an engine setting, not per call
DEFAULT_MAX_BUFFERED_S = 30.0  # audio a stream may leave unread before it is cancelled (sessions, the server)
DEFAULT_FIRST_CHUNK, DEFAULT_CHUNK = 1, 8  # the streaming codec's chunk schedule in frames (higgs_rt.codec.stream)
MAX_CHUNK = 64  # a steady chunk's frames at most (2.56 s): the codec's buffers and CUDA graphs grow with it
DEFAULT_PREFILL_TOKENS = 512  # the batch engine's prompt positions prefilled per decode tick
MAX_BODY_BYTES = 16 << 20  # a speech request to the server: JSON with an optional base64 reference recording
MIN_CONTEXT, MAX_CONTEXT = 16, 131072  # the Talker's RoPE is defined up to 131072 positions (Llama 3.2)


class ParamError(ValueError):
    """A parameter's value refused, by its row's check or by the engine (a max_frames that leaves no room in the
    context); `param` is its name in the table (or a session setting's, max_chars), so a server names the field at
    fault without reading the message."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def api_name(param: str) -> str:
    """A parameter's name in an HTTP request: the table's api_name (max_frames -> max_new_tokens), else its own."""
    row = BY_NAME.get(param)
    return row.api_name if row is not None and row.api_name is not None else param


def _show(value) -> str:
    """A value for an error message; a huge integer by its size (printing it whole can itself fail)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value) if isinstance(value, str) else str(value)


def check_context(context, name: str = "context") -> int:
    """KV cache positions per slot: an integer in [MIN_CONTEXT, MAX_CONTEXT], else a one-line ValueError."""
    if isinstance(context, bool) or not isinstance(context, int) or not MIN_CONTEXT <= context <= MAX_CONTEXT:
        raise ValueError(f"{name} must be an integer in [{MIN_CONTEXT}, {MAX_CONTEXT}], got {_show(context)}")
    return context


@dataclass(frozen=True)
class Param:
    """One parameter: `low <= value <= high` (or `low < value` with low_open), or one of `choices`; a str one has
    at most `high` characters, and with `text` it goes into the prompt, so it is refused as the prompt builder
    refuses text (`higgs_rt.prompt.check_text`: nothing visible, a lone surrogate, a [SPEAKERn] tag)."""

    name: str
    kind: type
    default: object
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None
    api_name: str | None = None  # the HTTP request's name for it; None: not an HTTP field
    cli: bool = True
    nullable: bool = False
    text: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        if self.choices is not None:
            return " or ".join(str(c) for c in self.choices)
        lo = "(" if self.low_open else "["
        return f"{lo}{self.low}, {self.high}]"

    def check(self, value, name: str | None = None):
        """The value, checked (ints taken as floats where a float is wanted); else a one-line ParamError naming
        `name` (default: this parameter's name) and the allowed range."""
        name = name or self.name
        if value is None and self.nullable:
            return None
        if self.kind is str:
            if not isinstance(value, str):
                raise ParamError(f"{name} must be a string, got {type(value).__name__}", self.name)
            if self.high is not None and len(value) > self.high:
                raise ParamError(f"{name} must be at most {int(self.high)} characters, got {len(value)}", self.name)
            if self.text:
                from .prompt import check_text

                check_text(value, name)
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ParamError(f"{name} must be a number, got {type(value).__name__}", self.name)
        value = int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy scalars as Python's
        if self.kind is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise ParamError(f"{name} must be an integer, got {_show(value)}", self.name)
                value = int(value)
        else:
            if isinstance(value, int) and abs(value) > 2**53:
                raise ParamError(f"{name} must be in {self.bounds()}, got {_show(value)}", self.name)
            value = float(value)
            if not math.isfinite(value):
                raise ParamError(f"{name} must be a finite number in {self.bounds()}, got {_show(value)}", self.name)
        if self.choices is not None:
            if value not in self.choices:
                raise ParamError(f"{name} must be {self.bounds()}, got {_show(value)}", self.name)
            return value
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            raise ParamError(f"{name} must be in {self.bounds()}, got {_show(value)}", self.name)
        return value


PARAMS: tuple[Param, ...] = (
    Param("seed", int, 0, "random seed: the same seed gives the same speech", 0, 2**63 - 1, api_name="seed"),
    Param("temperature", float, 1.0, "sampling temperature; 0 takes the likeliest code (fully greedy with ras_window 0)",
          0.0, 100.0, api_name="temperature"),
    Param("top_p", float, 0.95, "nucleus sampling: keep the most likely codes up to this probability mass",
          0.0, 1.0, low_open=True, api_name="top_p"),
    Param("top_k", int, 50, "keep only the k most likely codes (0 = off)", 0, 2**31 - 1, api_name="top_k"),
    Param("ras_window", int, RAS_WINDOW, f"repetition-aware sampling over the last {RAS_WINDOW} frames (0 = off)",
          choices=(0, RAS_WINDOW)),
    Param("ras_max_repeat", int, 2, "with RAS on: a code seen this often in the window is redrawn", 1, RAS_WINDOW),
    Param("max_frames", int, MAX_FRAMES, "frames per utterance (25 frames = 1 s); longer text is split",
          MIN_FRAMES, 65536, api_name="max_new_tokens"),
    Param("scene", str, None, "a scene description for the prompt, e.g. 'Audio is recorded from a quiet room.'",
          high=2000, nullable=True, text=True),
)
BY_NAME = {p.name: p for p in PARAMS}
BY_API_NAME = {p.api_name: p for p in PARAMS if p.api_name is not None}


def check_api_field(api_name: str, value):
    """An HTTP request field's JSON value, checked by the table; a ValueError names the field as the API does."""
    return BY_API_NAME[api_name].check(value, api_name)


_METAVAR = {int: "N", float: "X", str: "TEXT"}


def add_cli_options(parser, names: tuple[str, ...] | None = None) -> None:
    """argparse options for the table's parameters (help shows the default and the range); `cli_params`
    checks the parsed values, so the CLI and the API refuse the same things."""
    for p in PARAMS:
        if not p.cli or (names is not None and p.name not in names):
            continue
        extra = "" if p.kind is str else f"; {p.bounds()}"
        default = "none" if p.default is None else p.default
        parser.add_argument(p.flag, type=p.kind, default=p.default, metavar=_METAVAR[p.kind],
                            help=f"{p.help} (default: {default}{extra})")


def cli_params(args) -> dict:
    """The table's values from parsed arguments, each checked; a ValueError names the option (--top-k)."""
    return {p.name: p.check(getattr(args, p.name), p.flag) for p in PARAMS if p.cli and hasattr(args, p.name)}


@dataclass
class SamplingParams:
    """Per-request sampling settings (the table's sampling rows). temperature 0 is greedy; ras_window 0 turns RAS
    off."""

    temperature: float = BY_NAME["temperature"].default
    top_p: float = BY_NAME["top_p"].default
    top_k: int = BY_NAME["top_k"].default
    ras_window: int = BY_NAME["ras_window"].default
    ras_max_repeat: int = BY_NAME["ras_max_repeat"].default
    seed: int = BY_NAME["seed"].default

    def validate(self) -> "SamplingParams":
        for f in fields(SamplingParams):
            setattr(self, f.name, BY_NAME[f.name].check(getattr(self, f.name)))
        return self


@dataclass
class SynthesisParams(SamplingParams):
    """Per-call settings: the sampling ones plus the frame budget per utterance and an optional scene."""

    max_frames: int = BY_NAME["max_frames"].default
    scene: str | None = field(default=None)

    @classmethod
    def create(cls, **params) -> "SynthesisParams":
        """Checked construction: unknown names are a TypeError, bad values a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise TypeError(f"unknown synthesis parameter(s): {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(known))})")
        return cls(**params).validate()

    def validate(self) -> "SynthesisParams":
        super().validate()
        self.max_frames = BY_NAME["max_frames"].check(self.max_frames)
        self.scene = BY_NAME["scene"].check(self.scene)
        return self

    def sampling(self, utterance: int) -> SamplingParams:
        """Utterance i of one call uses seed + i: one seed gives one reproducible stream."""
        own = {f.name: getattr(self, f.name) for f in fields(SamplingParams)}
        return SamplingParams(**dict(own, seed=(self.seed + utterance) % 2**63)).validate()
