"""higgs-rt: a lean, fast, embeddable runtime for Higgs-Audio v2 text-to-speech.

The public API, imported on first use (PEP 562), so `import higgs_rt` stays cheap: it loads neither torch nor
any optional part (sounddevice, soundfile, the server).

    from higgs_rt import TTS
    tts = TTS("bosonai/higgs-audio-v2-generation-3B-base")
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "TTS": "engine",
    "Model": "model",
    "Voice": "types",
    "Stream": "types",
    "StreamStats": "types",
    "SynthesisParams": "params",
    "SamplingParams": "params",
    "PARAMS": "params",
    "BatchEngine": "batch",
    "QueueFull": "batch",
    "VoiceStore": "voices",
    "VoiceError": "voices",
    "AudioDeviceError": "audio_out",
    "ModelNotFoundError": "hub",
    "CodecNotFoundError": "codec",
    "CompiledArtifactsWarning": "compiled",
}
__all__ = ["__version__", *_EXPORTS]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("higgs-rt")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'higgs_rt' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
