"""The OpenAI speech request: a JSON body checked into a `SpeechRequest`, or an `ApiError` that names the field.

Fields the model cannot honour are refused rather than ignored, so a client never gets audio that silently
differs from what it asked for. Sampling fields are checked by the one table of synthesis parameters
(`higgs_rt.params`), whose bounds are what the engine holds. Nothing in a body
can raise anything but an `ApiError`: integers too long to be a parameter, NaN and infinities, deep nesting and
text that is not Unicode (lone surrogates) are all refused with the field that holds them. A streaming session's
settings (`parse_session`, the WebSocket's open message) are the same fields, checked by the same code, and the
engine's refusal of either is named by the same mapping (`engine_error`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field

from .audio_in import TranscriptError
from .params import BY_API_NAME, ParamError, api_name, check_api_field
from .prompt import PromptError, check_text, check_unicode

FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
STREAM_FORMATS = ("audio", "sse")
DEFAULT_VOICE = "default"
# OpenAI's built-in voices: programs pass them unchanged; without a stored voice of that name, the model's own
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                           "sage", "shimmer", "verse"})
MAX_INPUT_CHARS = 4096  # as OpenAI's speech endpoint
MAX_INT_DIGITS = 24  # longer integer literals are no parameter's value: kept as `HugeNumber`, never converted

# field -> why it is refused (a value of None, "" or false asks for nothing and is accepted)
UNSUPPORTED = {
    "instructions": "style instructions are not supported by this model",
    "task_type": "task types are not supported: this server only does text-to-speech",
    "language": "language hints are not supported: the model infers the language from the text",
    "x_vector_only_mode": "x-vector-only cloning is not supported: clone with ref_audio + ref_text",
    "speaker_embedding": "speaker embeddings are not supported: clone with ref_audio + ref_text",
}
KNOWN = {"model", "input", "voice", "response_format", "stream", "stream_format", "speed", "ref_audio", "ref_text",
         *BY_API_NAME, *UNSUPPORTED}
SESSION_FIELDS = (KNOWN - {"input", "stream", "stream_format"}) | {"max_chars"}
SESSION_FORMATS = ("pcm",)  # a session's audio goes out as binary frames of 16-bit PCM


class ApiError(Exception):
    """An error reply: HTTP status and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class SpeechRequest:
    input: str
    voice: str = DEFAULT_VOICE
    response_format: str = "wav"
    stream: bool = False
    stream_format: str = "audio"
    params: dict = field(default_factory=dict)  # SynthesisParams fields
    ref_audio: bytes | None = None
    ref_text: str | None = None
    max_chars: int | None = None  # a session's longest utterance (None: the longest max_new_tokens allows)

    @property
    def streamed(self) -> bool:
        return self.stream or self.stream_format == "sse"


def printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate a client sent, quoted back in an error, as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class HugeNumber:
    """An integer literal too long to be any parameter's value (converting it can take seconds, or raise)."""

    def __init__(self, digits: str):
        self.length = len(digits.lstrip("-"))


def parse_json(body: bytes | str, what: str = "the request body"):
    """The body's JSON value; a malformed or pathological body is a 400 (the field that holds a bad number is
    named later, by `parse_speech`)."""
    try:
        return json.loads(body, parse_int=lambda s: int(s) if len(s) <= MAX_INT_DIGITS else HugeNumber(s))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"{what} is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(f"{what} is nested too deeply", code="invalid_json") from None


def parse_speech(body, max_input_chars: int = MAX_INPUT_CHARS, benchmark: bool = False) -> SpeechRequest:
    """benchmark: accept `ignore_eos` (utterances run to max_new_tokens; `serve --benchmark` only)."""
    _check_fields(body, KNOWN, benchmark)
    text = _get(body, "input", "string")
    if text is None:
        raise ApiError("'input' is required", "input", code="missing_parameter")
    req = SpeechRequest(input=checked_text(text, "input", max_input_chars))
    _parse_voice(body, req)
    req.response_format = _choice(body, "response_format", tuple(FORMATS), "wav")
    req.stream_format = _choice(body, "stream_format", STREAM_FORMATS, "audio")
    req.stream = bool(_get(body, "stream", "boolean"))
    if req.streamed and req.response_format == "flac":
        raise ApiError("flac cannot be streamed: use wav or pcm, or stream=false", "response_format")
    _parse_params(body, req, max_input_chars, benchmark)
    return req


def parse_session(body, max_input_chars: int = MAX_INPUT_CHARS, benchmark: bool = False) -> SpeechRequest:
    """A streaming session's settings (the WebSocket's open message): the speech request's fields, checked the
    same way, but for the text (it comes in pieces) and the streaming ones; the audio is always 16-bit PCM.
    Returns a SpeechRequest with an empty `input`."""
    _check_fields(body, SESSION_FIELDS, benchmark)
    req = SpeechRequest(input="", stream=True)
    _parse_voice(body, req)
    req.response_format = _choice(body, "response_format", SESSION_FORMATS, "pcm")
    req.max_chars = _get(body, "max_chars", "integer")
    if req.max_chars is not None and req.max_chars < 1:
        raise ApiError(f"'max_chars' must be at least 1, got {req.max_chars}", "max_chars", code="out_of_range")
    _parse_params(body, req, max_input_chars, benchmark)
    return req


def _check_fields(body, known: set[str], benchmark: bool) -> None:
    """An object of known fields, none asking for what the model cannot honour."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    for name in body:
        if name not in known and not (benchmark and name == "ignore_eos"):
            raise ApiError(f"unknown field '{name}'", name, code="unknown_parameter")
    for name, why in UNSUPPORTED.items():
        value = body.get(name)
        if not (value is None or value is False or value == ""):  # asks for nothing (0 is no "nothing")
            raise ApiError(f"'{name}' is not supported: {why}", name, code="unsupported_parameter")
    speed = _get(body, "speed", "number")
    if speed is not None and speed != 1.0:
        raise ApiError("'speed' other than 1.0 is not supported", "speed", code="unsupported_parameter")
    _get(body, "model", "string")


def _parse_voice(body: dict, req: SpeechRequest) -> None:
    voice = body.get("voice")
    if voice is None:
        return
    if isinstance(voice, dict) and set(voice) == {"id"}:  # OpenAI's custom voice object
        voice = voice["id"]
    if not isinstance(voice, str) or not voice.strip():
        raise ApiError("'voice' must be a voice name (a string) or {\"id\": name}", "voice")
    req.voice = checked_text(voice, "voice", 64)


def _parse_params(body: dict, req: SpeechRequest, max_input_chars: int, benchmark: bool) -> None:
    """ignore_eos (benchmark servers), the sampling fields and the reference recording."""
    if benchmark and _get(body, "ignore_eos", "boolean"):
        req.params["ignore_eos"] = True
    for name, param in BY_API_NAME.items():
        value = _get(body, name, "integer" if param.kind is int else "number")
        if value is not None:
            try:
                req.params[param.name] = check_api_field(name, value)
            except ValueError as e:
                raise ApiError(str(e), name, code="out_of_range") from None
    _parse_reference(body, req, max_input_chars)


def decode_base64_audio(value: str, param: str = "ref_audio") -> bytes:
    """A data URL (data:audio/wav;base64,...) or bare base64 -> bytes."""
    data = value
    if value.startswith("data:"):
        if ";base64," not in value[:200]:
            raise ApiError(f"'{param}' must be a base64 data URL (data:audio/...;base64,...)", param)
        data = value.split(",", 1)[1]
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"'{param}' is not valid base64", param, code="invalid_base64") from None
    if not raw:
        raise ApiError(f"'{param}' is empty", param)
    return raw


def in_api_terms(error: Exception | str) -> str:
    """An engine error's message with the engine's names for request fields replaced by the API's."""
    return str(error).replace("max_frames", "max_new_tokens")


def transcript_param(req: SpeechRequest) -> str:
    """The field an error of the reference transcript names: `ref_text`, or `voice` for a stored voice's."""
    return "ref_text" if req.ref_text is not None else "voice"


def engine_error(error: Exception, req: SpeechRequest, text_param: str | None) -> ApiError:
    """The engine's refusal of a request (`BatchEngine.submit` or `.session`: a PromptError, ValueError or TypeError)
    as a 400 naming the field at fault, by the error's type, for the HTTP API and the WebSocket alike: a reference
    transcript that leaves the text no room (`TranscriptError`) names `transcript_param`; a parameter's value
    (`ParamError`: max_new_tokens leaving no room for any utterance, a session's max_chars) names that field
    (out_of_range); anything else is the text's fault: `text_param` (None where there is no text yet)."""
    message = in_api_terms(error)
    if isinstance(error, TranscriptError):
        return ApiError(message, transcript_param(req))
    if isinstance(error, ParamError):
        return ApiError(message, api_name(error.param), code="out_of_range")
    return ApiError(message, text_param)


def _parse_reference(body: dict, req: SpeechRequest, max_input_chars: int) -> None:
    audio, text = _get(body, "ref_audio", "string"), _get(body, "ref_text", "string")
    if (audio is None) != (text is None):
        missing = "ref_text" if text is None else "ref_audio"
        raise ApiError("'ref_audio' and 'ref_text' go together: give both or neither", missing,
                       code="missing_parameter")
    if audio is None:
        return
    if req.voice != DEFAULT_VOICE:
        raise ApiError("give either a named 'voice' or 'ref_audio' + 'ref_text', not both", "voice")
    req.ref_audio, req.ref_text = decode_base64_audio(audio), checked_text(text, "ref_text", max_input_chars)


def checked_text(value: str, param: str, max_chars: int) -> str:
    """Text the model can read: Unicode (no lone surrogates, which the tokenizer cannot take, checked for the
    whole text since every utterance of it is prompted), at most max_chars characters, not empty."""
    checked_piece(value, param, max_chars)
    try:
        return check_text(value, param)
    except PromptError as e:
        raise ApiError(str(e), param) from None


def checked_piece(value: str, param: str, max_chars: int) -> str:
    """A piece of text (maybe empty: a session's text comes in pieces): at most max_chars characters, Unicode."""
    if len(value) > max_chars:
        raise ApiError(f"'{param}' is {len(value)} characters long: at most {max_chars} are accepted", param,
                       code="string_above_max_length")
    try:
        check_unicode(value, f"'{param}'")
    except PromptError as e:
        raise ApiError(str(e), param) from None
    return value


_KINDS = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}
_JSON_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
               HugeNumber: "integer"}


def _get(body: dict, name: str, kind: str):
    """body[name] if it is of the JSON kind (a boolean is no number here), None if absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, HugeNumber) and kind in ("integer", "number"):
        raise ApiError(f"'{name}' is out of range: a {value.length}-digit number", name, code="out_of_range")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(f"'{name}' must be a finite number, got {value}", name, code="out_of_range")
    if isinstance(value, bool) != (kind == "boolean") or not isinstance(value, _KINDS[kind]):
        got = _JSON_NAMES.get(type(value), type(value).__name__)
        article = "an" if kind == "integer" else "a"
        raise ApiError(f"'{name}' must be {article} {kind}, got {got}", name, code="invalid_type")
    if kind == "string":
        checked_piece(value, name, len(value))
    return float(value) if kind == "number" else value


def _choice(body: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = _get(body, name, "string")
    if value is None:
        return default
    if value not in choices:
        raise ApiError(f"'{name}' must be one of {', '.join(choices)}, got '{value}'", name)
    return value
