"""Cloned voices: reference recordings encoded once and kept, by name (`voice add`) or by content (`--ref-audio`).

Files live under $HIGGS_RT_HOME, else ~/.cache/higgs-rt:
    voices/NAME.safetensors         named voices
    refs/AUDIOSHA-CODECID.safetensors   references given per call, cached by audio hash + codec id
`refs/` is a cache: past `max_ref_bytes` (default 1 GiB) its least recently used entries are deleted (a hit
refreshes an entry's modification time). Each file holds `codes` [T, Q] int64 and metadata (transcript, audio sha256, codec id); a named voice also keeps
`audio`, its mono reference at the codec's rate (24 kHz; the rate is kept as `sample_rate`, a file without it is
taken to be at the rate of the codec reading it), so that a voice encoded by another codec (another codec id) is
re-encoded from it and rewritten instead of being refused; that audio is checked first as a new recording is
(`audio_in.load_reference`). Names match [A-Za-z0-9_-]{1,64}: no path can be smuggled in.

`VoiceLibrary` ties a store to one codec: it loads the codec's encoder on first need only and hands the engine
`Voice`s (transcript + delayed frames with BOS/EOS, ready for the clone prompt).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .audio_in import ReferenceAudioError, check_transcript, load_reference
from .codec.model import delay_pattern
from .home import default_home
from .types import Voice
from .prompt import check_text

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FORMAT = "higgs-rt-voice-1"
REF_CACHE_BYTES = 1 << 30


class VoiceError(ValueError):
    """A bad voice name, an unknown voice, or a voice file that cannot be read; one line."""


def check_name(name) -> str:
    """The name, or a VoiceError quoting at most its first 64 characters (a name from a client may be long)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name)
        shown = shown if len(shown) <= 66 else shown[:65] + "..."
        raise VoiceError(f"bad voice name {shown}: use 1 to 64 letters, digits, '_' or '-'")
    return name


@dataclass
class StoredVoice:
    text: str
    codes: torch.Tensor  # [T, Q] aligned codes
    audio_sha256: str
    codec_id: str
    audio: torch.Tensor | None = None  # [n] float32 at sample_rate (named voices only)
    sample_rate: int | None = None  # the audio's; None: not recorded (a file written before it was)


class VoiceStore:
    def __init__(self, home: str | Path | None = None, max_ref_bytes: int = REF_CACHE_BYTES):
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.dir = self.home / "voices"
        self.refs = self.home / "refs"
        self.max_ref_bytes = max_ref_bytes

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}.safetensors"

    def reference_path(self, audio_sha256: str, codec: str) -> Path:
        return self.refs / f"{audio_sha256}-{codec}.safetensors"

    def used(self, path: Path) -> None:
        """Mark a cached reference as just used (least recently used entries are evicted first)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def evict_references(self, keep: Path) -> None:
        """Delete the least recently used cached references until refs/ holds at most max_ref_bytes (`keep`,
        the entry just written, stays whatever its size)."""
        entries = []
        for path in self.refs.glob("*.safetensors"):
            try:
                stat = path.stat()
            except OSError:  # removed meanwhile (another process evicting)
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_ref_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size

    def names(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(p.stem for p in self.dir.glob("*.safetensors") if p.is_file() and NAME.fullmatch(p.stem))

    def save(self, path: Path, voice: StoredVoice) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors = {"codes": voice.codes.to("cpu", torch.int64).contiguous()}
        if voice.audio is not None:
            tensors["audio"] = voice.audio.to("cpu", torch.float32).contiguous()
        meta = {"format": FORMAT, "text": voice.text, "audio_sha256": voice.audio_sha256, "codec_id": voice.codec_id}
        if voice.audio is not None and voice.sample_rate is not None:
            meta["sample_rate"] = str(voice.sample_rate)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(partial), metadata=meta)
            os.replace(partial, path)  # readers see the old file or the new one, never half of one
        except (OSError, SafetensorError) as e:  # safetensors' own error for a failed write (a full disk)
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise OSError(f"cannot write {path.name} to {path.parent}: {getattr(e, 'strerror', None) or e}") from None

    def load(self, path: Path, what: str) -> StoredVoice:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("format") != FORMAT or "codes" not in tensors or tensors["codes"].dim() != 2:
                raise ValueError("not a higgs-rt voice file")
            rate = meta.get("sample_rate")
            return StoredVoice(meta["text"], tensors["codes"], meta["audio_sha256"], meta["codec_id"],
                               tensors.get("audio"), None if rate is None else int(rate))
        except Exception as e:
            raise VoiceError(f"{what} ({path}) cannot be read ({' '.join(str(e).split())}): add it again") from None

    def get(self, name: str) -> StoredVoice:
        path = self.path(name)
        if not path.is_file():
            known = ", ".join(self.names()) or "none stored yet"
            raise VoiceError(f"no voice named {name!r} in {self.dir} (known: {known}); add one with "
                             f"`higgs-rt voice add {name} --audio REF.wav --text TRANSCRIPT`")
        return self.load(path, f"voice {name!r}")

    def remove(self, name: str) -> None:
        path = self.path(name)
        if not path.is_file():
            raise VoiceError(f"no voice named {name!r} in {self.dir}")
        path.unlink()


class VoiceLibrary:
    """A `VoiceStore` used with one codec (its directory): add, look up and remove voices; encode lazily."""

    def __init__(self, codec_dir: str | Path, device: str | torch.device = "cpu", store: VoiceStore | None = None):
        from .codec.config import CodecConfig
        from .codec.load import codec_id

        self.codec_dir = Path(codec_dir)
        self.config = CodecConfig.from_dir(self.codec_dir)
        self.device = device
        self.store = store or VoiceStore()
        self.codec_id = codec_id(self.codec_dir)
        self._encoder = None

    @property
    def encoder(self):
        """The codec's encode path, read from disk the first time a reference has to be encoded."""
        if self._encoder is None:
            from .codec.load import load_encoder

            self._encoder = load_encoder(self.codec_dir, device=self.device)
        return self._encoder

    def _voice(self, text: str, codes: torch.Tensor) -> Voice:
        k = self.config.codebook_size  # the Talker's stream BOS is K and its EOS K + 1
        return Voice(text, delay_pattern(codes, k, k + 1))

    def _checked(self, stored: StoredVoice, path: Path, what: str) -> StoredVoice:
        """A stored voice this codec can use. Of this codec: its codes, [T >= 1, num_quantizers] integers in
        0..codebook_size-1 (a damaged or hand-made file's codes past the codebook indexed past the embeddings, an
        IndexError, on CUDA a device-side assert that ends the process, or failed in a shape mismatch). Of another
        codec: its audio, to be re-encoded, float32 [samples] and checked as a new recording is
        (`load_reference`: finite, in range, not silent, 0.5 to 30 s), returned at this codec's rate (NaN samples
        were encoded into codes of nothing, a [2, n] tensor into a batch of two voices)."""
        codes, q, k = stored.codes, self.config.num_quantizers, self.config.codebook_size
        if stored.codec_id == self.codec_id:
            if not (codes.dtype == torch.int64 and codes.shape[0] >= 1 and codes.shape[1] == q
                    and int(codes.min()) >= 0 and int(codes.max()) < k):
                raise VoiceError(f"{what} ({path}) cannot be read (its codes must be int64 [frames, {q}] from 0 to "
                                 f"{k - 1}, got {codes.dtype} {list(codes.shape)} outside that): add it again")
            return stored
        audio, rate = stored.audio, self.config.sample_rate if stored.sample_rate is None else stored.sample_rate
        if audio is None:
            raise VoiceError(f"{what} was encoded by another codec ({stored.codec_id}) and keeps no audio to "
                             "re-encode: add it again")
        try:
            if audio.dtype != torch.float32 or audio.dim() != 1:
                raise ReferenceAudioError(f"its audio must be float32 [samples], got {audio.dtype} "
                                          f"{list(audio.shape)}")
            ref = load_reference(audio, rate, self.config.sample_rate)
        except ReferenceAudioError as e:
            raise VoiceError(f"{what} ({path}) was encoded by another codec and its audio cannot be re-encoded "
                             f"({e}): add it again") from None
        return replace(stored, audio=ref.samples, sample_rate=ref.sample_rate)

    def add(self, name: str, audio, text: str, sample_rate: int | None = None) -> StoredVoice:
        """Encode a reference (path or array + sample_rate) with its transcript and keep it as `name`."""
        path = self.store.path(name)
        text = check_text(check_transcript(text), "reference transcript")
        ref = load_reference(audio, sample_rate, self.config.sample_rate)
        voice = StoredVoice(text, self.encoder.encode(ref.samples).cpu(), ref.sha256, self.codec_id, ref.samples,
                            ref.sample_rate)
        self.store.save(path, voice)
        return voice

    def voice(self, name: str) -> Voice:
        """A stored voice, ready for the clone prompt (re-encoded first if another codec made its codes)."""
        stored = self._checked(self.store.get(name), self.store.path(name), f"voice {name!r}")
        if stored.codec_id != self.codec_id:  # its audio checked, at this codec's rate
            stored = replace(stored, codes=self.encoder.encode(stored.audio).cpu(), codec_id=self.codec_id)
            try:
                self.store.save(self.store.path(name), stored)
            except OSError:  # kept for next time when it can be; this call has its codes
                pass
        return self._voice(stored.text, stored.codes)

    def reference(self, audio, text: str, sample_rate: int | None = None) -> Voice:
        """A one-off reference (path or array); its codes are cached by audio hash + codec id."""
        text = check_text(check_transcript(text), "reference transcript")
        ref = load_reference(audio, sample_rate, self.config.sample_rate)
        path = self.store.reference_path(ref.sha256, self.codec_id)
        if path.is_file():
            try:
                voice = self._voice(text, self._checked(self.store.load(path, "cached reference"), path,
                                                        "cached reference").codes)
                self.store.used(path)
                return voice
            except VoiceError:
                pass  # a damaged cache entry is encoded again below
        codes = self.encoder.encode(ref.samples).cpu()
        try:  # the cache only saves the next call an encode: a full or read-only disk does not fail this one
            self.store.save(path, StoredVoice(text, codes, ref.sha256, self.codec_id))
            self.store.evict_references(keep=path)
        except OSError:
            pass
        return self._voice(text, codes)

    def names(self) -> list[str]:
        return self.store.names()

    def remove(self, name: str) -> None:
        self.store.remove(name)
