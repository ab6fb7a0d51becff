"""Cloned voices end to end on the tiny random model: the store (names, files, restarts, other codecs, the
--ref-audio cache), the engine API (`add_voice`, `voices`, `remove_voice`, `stream(voice=NAME)`) and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

import higgs_rt.codec.load as codec_load
from higgs_rt.audio_in import ReferenceAudioError, load_reference
from higgs_rt.cli import main
from higgs_rt.codec import codec_id, delay_pattern, load_encoder
from higgs_rt.engine import TTS, SynthesisParams
from higgs_rt.fixtures.codec import make_codec
from higgs_rt.pcm import to_int16
from higgs_rt.voices import VoiceError, VoiceLibrary, VoiceStore

from conftest import REFERENCE_TEXT

K = 16
SAY = dict(seed=1, max_frames=40)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HIGGS_RT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tts(random_model):
    return TTS(random_model, device="cpu")


@pytest.fixture
def encoder_loads(monkeypatch):
    """Counts loads of the codec's encode weights."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return load_encoder(*args, **kwargs)

    monkeypatch.setattr(codec_load, "load_encoder", counting)
    return calls


def fresh(tts: TTS) -> TTS:
    tts._voice_library = None  # as a new engine would start: no library, no encoder (the env decides the home)
    return tts


# ----------------------------------------------------------------------------- names and files


@pytest.mark.parametrize("name", ["", "../evil", "a/b", "a.b", "x" * 65, "naïve", " a", "a b", None, 7])
def test_bad_names_are_refused(name, tmp_path):
    store = VoiceStore(tmp_path)
    with pytest.raises(VoiceError, match="bad voice name .*1 to 64 letters, digits, '_' or '-'"):
        store.path(name)
    assert not (tmp_path / "voices").exists()


def test_good_names_map_into_the_voices_dir(tmp_path):
    store = VoiceStore(tmp_path)
    for name in ("a", "Alice_2", "x" * 64, "-_-"):
        assert store.path(name).parent == tmp_path / "voices"


def test_encoder_loads_only_when_a_voice_is_cloned(tts, home, speech, encoder_loads):
    fresh(tts)
    tts.synthesize("No cloning here.", **SAY)
    assert tts.voices() == [] and not encoder_loads
    voice = tts.add_voice("alice", speech["22k"], REFERENCE_TEXT)
    assert len(encoder_loads) == 1
    ref = load_reference(speech["22k"])
    codes = tts.voice_library.encoder.encode(ref.samples)
    assert torch.equal(voice.frames, delay_pattern(codes, K, K + 1)) and voice.text == REFERENCE_TEXT
    assert voice.frames.shape == (codes.shape[0] + 9, 8)
    fresh(tts)
    assert torch.equal(tts.resolve_voice("alice").frames, voice.frames) and len(encoder_loads) == 1


def test_a_voice_by_name_speaks_like_the_voice_itself(tts, home, speech):
    voice = fresh(tts).add_voice("bob", speech["48k"], REFERENCE_TEXT)
    by_name = tts.synthesize("Hello there.", voice="bob", **SAY)
    assert np.array_equal(by_name, tts.synthesize("Hello there.", voice=voice, **SAY))
    assert not np.array_equal(by_name, tts.synthesize("Hello there.", **SAY))
    prompt = tts.model.prompt("Hello there.", voice, SynthesisParams.create(**SAY))
    assert int((prompt.ids == tts.talker.cfg.audio_out_token_id).sum()) == voice.frames.shape[0]
    tts.remove_voice("bob")
    assert tts.voices() == []
    with pytest.raises(VoiceError, match="no voice named 'bob'"):
        tts.synthesize("Hello.", voice="bob", **SAY)
    with pytest.raises(VoiceError, match="no voice named 'bob'"):
        tts.remove_voice("bob")


def test_arrays_need_their_rate_and_give_the_files_codes(tts, home, speech):
    data, rate = sf.read(speech["22k"], dtype="int16")
    from_array = fresh(tts).add_voice("arr", data, REFERENCE_TEXT, sample_rate=rate)
    assert torch.equal(from_array.frames, tts.add_voice("file", speech["22k"], REFERENCE_TEXT).frames)
    with pytest.raises(ReferenceAudioError, match="needs its sample_rate"):
        tts.add_voice("arr", data, REFERENCE_TEXT)
    with pytest.raises(ReferenceAudioError, match="needs its transcript"):
        tts.add_voice("arr", data, "  ", sample_rate=rate)
    with pytest.raises(ReferenceAudioError, match="silent"):
        tts.add_voice("quiet", np.zeros(rate, np.int16), REFERENCE_TEXT, sample_rate=rate)
    assert tts.voices() == ["arr", "file"]


def test_voice_from_another_codec_is_reencoded(tts, home, speech, tmp_path):
    fresh(tts).add_voice("carol", speech["22k"], REFERENCE_TEXT)
    other_dir = make_codec(tmp_path / "other-codec", "tiny", seed=9)
    other = VoiceLibrary(other_dir, store=VoiceStore(home))
    assert other.codec_id != tts.voice_library.codec_id == codec_id(tts.codec_dir)
    voice = other.voice("carol")
    want = load_encoder(other_dir).encode(load_reference(speech["22k"]).samples)
    assert torch.equal(voice.frames, delay_pattern(want, K, K + 1))
    assert VoiceStore(home).get("carol").codec_id == other.codec_id  # rewritten for the codec now in use


def test_corrupt_voice_file_is_a_clear_error(tts, home):
    (home / "voices").mkdir(parents=True)
    (home / "voices" / "dave.safetensors").write_bytes(b"\x00garbage" * 50)
    with pytest.raises(VoiceError, match=r"voice 'dave' \(.*dave.safetensors\) cannot be read .*: add it again"):
        fresh(tts).resolve_voice("dave")


def test_reference_audio_is_encoded_once_per_codec(tts, home, speech, encoder_loads, monkeypatch):
    library = fresh(tts).voice_library
    encodes = []
    real = library.encoder.encode
    monkeypatch.setattr(library.encoder, "encode", lambda wav: encodes.append(1) or real(wav))
    first = tts.clone_voice(speech["8k"], REFERENCE_TEXT)
    again = tts.clone_voice(speech["8k"], "Another transcript.")
    assert len(encodes) == 1 and torch.equal(first.frames, again.frames) and again.text == "Another transcript."
    cached = home / "refs" / f"{load_reference(speech['8k']).sha256}-{library.codec_id}.safetensors"
    assert cached.is_file()
    cached.write_bytes(b"damaged")
    assert torch.equal(tts.clone_voice(speech["8k"], REFERENCE_TEXT).frames, first.frames) and len(encodes) == 2


def test_a_store_that_cannot_be_written(tts, home, speech):
    """A home that is a file: adding a voice fails in one line naming where; a one-off reference still speaks
    (its cache only saves the next call an encode)."""
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text("a file, not a directory")
    with pytest.raises(OSError, match=r"cannot write erin.safetensors to .*home/voices: Not a directory"):
        fresh(tts).add_voice("erin", speech["8k"], REFERENCE_TEXT)
    voice = tts.clone_voice(speech["8k"], REFERENCE_TEXT)
    assert voice.frames.shape[1] == 8 and voice.text == REFERENCE_TEXT.strip()
    assert not list(home.parent.glob("**/*.partial"))


def test_reference_cache_evicts_the_least_recently_used(tts, home, encoder_loads, monkeypatch):
    """refs/ stays under max_ref_bytes: the oldest unused entries go first; a hit refreshes an entry."""
    library = fresh(tts).voice_library
    refs = [0.1 * np.random.default_rng(i).standard_normal(16000).astype(np.float32) for i in range(4)]
    path = lambda i: library.store.reference_path(load_reference(refs[i], 16000).sha256, library.codec_id)  # noqa
    tts.clone_voice(refs[0], "Zero.", 16000)
    tts.clone_voice(refs[1], "One.", 16000)
    library.store.max_ref_bytes = int(2.5 * path(0).stat().st_size)  # room for two entries
    os.utime(path(0), (1e9, 1e9))
    os.utime(path(1), (1e9 + 50, 1e9 + 50))  # 0 used before 1
    tts.clone_voice(refs[0], "Zero again.", 16000)  # a hit: 0 is now the most recent
    tts.clone_voice(refs[2], "Two.", 16000)  # over the cap: 1, the least recently used, goes
    assert [path(i).is_file() for i in range(3)] == [True, False, True]
    library.store.max_ref_bytes = 0  # the entry just written always stays
    tts.clone_voice(refs[3], "Three.", 16000)
    assert [p.name for p in (home / "refs").iterdir()] == [path(3).name]


# ----------------------------------------------------------------------------- CLI


def cli(*args, home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "higgs_rt.cli", *map(str, args)], text=True, capture_output=True,
                          timeout=300, env={**os.environ, "HIGGS_RT_HOME": str(home)})


def test_cli_store_survives_new_processes(random_model, tts, home, speech, tmp_path):
    r = cli("voice", "add", "erin", "--audio", speech["stereo"], "--text", REFERENCE_TEXT, "--model", random_model,
            home=home)
    assert r.returncode == 0 and "added voice erin" in r.stderr, r.stderr
    r = cli("voice", "list", home=home)
    assert r.returncode == 0 and r.stdout.startswith("erin\t") and REFERENCE_TEXT in r.stdout
    out = tmp_path / "erin.wav"
    r = cli("speak", "Hello there.", "--model", random_model, "--voice", "erin", "--out", out, "--seed", 1,
            "--max-frames", 40, home=home)
    assert r.returncode == 0, r.stderr
    want = fresh(tts).synthesize("Hello there.", voice="erin", **SAY)  # this process: a new library, same files
    np.testing.assert_array_equal(sf.read(out, dtype="int16")[0], to_int16(want))
    r = cli("voice", "rm", "erin", home=home)
    assert r.returncode == 0 and VoiceStore(home).names() == []


def test_cli_ref_audio_speaks_like_the_api(random_model, tts, home, speech, tmp_path):
    out = tmp_path / "ref.wav"
    r = cli("speak", "Hello there.", "--model", random_model, "--ref-audio", speech["flac"], "--ref-text",
            REFERENCE_TEXT, "--out", out, "--seed", 1, "--max-frames", 40, home=home)
    assert r.returncode == 0, r.stderr
    want = fresh(tts).synthesize("Hello there.", voice=tts.clone_voice(speech["flac"], REFERENCE_TEXT), **SAY)
    np.testing.assert_array_equal(sf.read(out, dtype="int16")[0], to_int16(want))
    assert len(list((home / "refs").iterdir())) == 1  # the process and the API shared one cached encoding


@pytest.fixture
def corrupt_wav(speech, tmp_path):
    path = tmp_path / "corrupt.wav"
    path.write_bytes(speech["22k"].read_bytes()[:40])
    return path


@pytest.mark.parametrize("args,code,message", [
    (["voice", "add", "../evil", "--audio", "{ref}", "--text", "t"], 2, "bad voice name '../evil'"),
    (["voice", "add", "bob", "--audio", "{corrupt}", "--text", "t"], 2, "corrupt.wav is not a readable WAV/FLAC"),
    (["voice", "add", "bob", "--audio", "{ref}"], 2, "voice add needs --audio REF.wav and --text TRANSCRIPT"),
    (["voice", "add", "bob", "--audio", "{ref}", "--text", "t", "--codec", "{tmp}"], 1, "no Higgs-Audio v2 codec"),
    (["voice", "rm", "nobody"], 2, "no voice named 'nobody'"),
    (["speak", "hi", "--voice", "nobody", "--out", "x.wav"], 2, "no voice named 'nobody'"),
    (["speak", "hi", "--voice", "a/b", "--out", "x.wav"], 2, "bad voice name 'a/b'"),
    (["speak", "hi", "--ref-audio", "{ref}", "--out", "x.wav"], 2, "--ref-audio and --ref-text go together"),
    (["speak", "hi", "--ref-text", "t", "--out", "x.wav"], 2, "--ref-audio and --ref-text go together"),
    (["speak", "hi", "--voice", "a", "--ref-audio", "{ref}", "--ref-text", "t", "--out", "x.wav"], 2,
     "alternatives"),
    (["speak", "hi", "--ref-audio", "{corrupt}", "--ref-text", "t", "--out", "x.wav"], 2, "not a readable"),
    (["speak", "hi", "--ref-audio", "{ref}", "--ref-text", " ", "--out", "x.wav"], 2, "needs its transcript"),
    (["voice", "add", "bob", "--audio", "{empty}", "--text", "t"], 2, "empty.wav holds no audio samples"),
    (["speak", "hi", "--ref-audio", "{empty}", "--ref-text", "t", "--out", "x.wav"], 2, "holds no audio samples"),
])
def test_cli_errors_are_one_line(args, code, message, home, speech, corrupt_wav, tmp_path, capsys, monkeypatch):
    """In-process (the same `main` the console script runs): exit code and a single stderr line, no traceback.
    (A WAV of a header only, its data chunk empty, was "0.00 s long".)"""
    from higgs_rt.pcm import wav_header

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty.wav").write_bytes(wav_header(24000, 0))
    args = [a.format(ref=speech["22k"], corrupt=corrupt_wav, tmp=tmp_path, empty=tmp_path / "empty.wav") for a in args]
    assert main(args) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_voice_list_lists_the_readable_voices_and_warns_of_a_corrupt_one(tts, home, speech, capsys, monkeypatch):
    """One corrupt file made `voice list` fail whole (exit 2, no voice listed): the readable voices are listed on
    stdout, each unreadable one is a warning line on stderr naming it and why, and the exit is 0; speaking in the
    corrupt voice is still a one-line error."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fresh(tts).add_voice("erin", speech["8k"], REFERENCE_TEXT)
    (home / "voices" / "dave.safetensors").write_bytes(b"\x00garbage" * 50)
    (home / "voices" / "carl.safetensors").mkdir()  # not a voice file: neither listed nor warned of
    assert main(["voice", "list"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("erin\t") and REFERENCE_TEXT in out and len(out.splitlines()) == 1, out
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("higgs-rt: warning: voice 'dave' (") and "dave.safetensors) cannot be read (" in err
    assert err.rstrip().endswith("add it again, or remove it: higgs-rt voice rm dave"), err
    assert main(["speak", "hi", "--voice", "dave", "--out", str(home / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("higgs-rt: error: voice 'dave' (") and len(err.splitlines()) == 1, err
    assert not (home / "x.wav").exists()


def test_voice_list_shows_each_transcript_on_one_line_with_control_characters_escaped(tts, home, speech, capsys):
    """A transcript with a newline listed its voice on two lines, and an escape sequence reached the terminal."""
    fresh(tts).add_voice("erin", speech["8k"], "First line,\nsecond \x1b[31mred\x07 line.")
    assert main(["voice", "list"]) == 0
    assert capsys.readouterr().out == "erin\t70 frames\tFirst line, second \\x1b[31mred\\x07 line.\n"


def test_a_full_disk_fails_add_voice_in_one_line_and_a_reference_still_speaks(tts, home, monkeypatch):
    """safetensors reports a failed write (a full disk) with its own error type, not OSError: adding a voice
    fails in one line naming the file, and a one-off reference still speaks (its cache is only a cache)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    ref = 0.1 * np.random.default_rng(7).standard_normal(16000).astype(np.float32)
    with pytest.raises(OSError, match=r"cannot write erin.safetensors to .*voices: .*No space left on device"):
        fresh(tts).add_voice("erin", ref, REFERENCE_TEXT, sample_rate=16000)
    voice = tts.clone_voice(ref, REFERENCE_TEXT, sample_rate=16000)
    assert voice.frames.shape[1] == 8 and not list(home.glob("**/*.safetensors")) + list(home.glob("**/.*partial"))


@pytest.mark.parametrize("damage", ["past the codebook", "negative", "too few quantizers", "float", "no frames"])
def test_a_voice_file_whose_codes_this_codec_cannot_read_is_a_clear_error(tts, home, speech, damage):
    """A voice file of this codec id whose codes lie outside the codebook (or have another shape or type) was
    loaded as it was: an IndexError traceback in the prompt's embedding (on CUDA a device-side assert that ends
    the process), a shape mismatch, or a float tensor used as indices. Now it is a VoiceError; a cached reference
    so damaged is encoded again."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    library = fresh(tts).voice_library
    tts.add_voice("erin", speech["22k"], REFERENCE_TEXT)
    path = home / "voices" / "erin.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    codes = tensors["codes"]
    tensors["codes"] = {"past the codebook": codes + K, "negative": codes - K, "too few quantizers": codes[:, :3],
                        "float": codes.float(), "no frames": codes[:0]}[damage].contiguous()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(VoiceError, match=r"voice 'erin' \(.*erin.safetensors\) cannot be read \(its codes must be "
                                         r"int64 \[frames, 8\] from 0 to 15, got .*\): add it again"):
        tts.resolve_voice("erin")
    first = tts.clone_voice(speech["8k"], REFERENCE_TEXT)
    cached = home / "refs" / f"{load_reference(speech['8k']).sha256}-{library.codec_id}.safetensors"
    save_file({"codes": (library.encoder.encode(load_reference(speech["8k"]).samples) + K).contiguous()},
              str(cached), metadata={"format": "higgs-rt-voice-1", "text": REFERENCE_TEXT, "audio_sha256": "x",
                                     "codec_id": library.codec_id})
    assert torch.equal(tts.clone_voice(speech["8k"], REFERENCE_TEXT).frames, first.frames)


def _rewrite(path, **change):
    """A voice file rewritten with some tensors (`codes`, `audio`) or metadata entries changed (None: removed)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for key, value in change.items():
        where = tensors if key in ("codes", "audio") else meta
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value.contiguous() if isinstance(value, torch.Tensor) else value
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("damage,message", [
    ("nan", r"contains NaN or infinite samples"),
    ("inf", r"contains NaN or infinite samples"),
    ("stereo", r"its audio must be float32 \[samples\], got torch.float32 \[\d+, 2\]"),
    ("channels first", r"its audio must be float32 \[samples\], got torch.float32 \[2, \d+\]"),
    ("int16", r"its audio must be float32 \[samples\], got torch.int16"),
    ("empty", r"holds no audio samples"),
    ("short", r"is 0\.10 s long"),
    ("silent", r"is silent"),
    ("huge", r"peaks at 1e\+06, far above full scale"),
    ("bad rate", r"sample rate must be an integer from 8000 to 192000 Hz, got 5"),
])
def test_a_voice_of_another_codec_whose_audio_is_damaged_is_a_clear_error(tts, home, speech, damage, message):
    """A voice of another codec is re-encoded from its stored audio, which went to the encoder as it was read: NaN
    samples into codes of nothing, a [n, 2] or [2, n] tensor into a traceback or a batch of two voices. It is now
    checked as a new recording is (`load_reference`), and a damaged one is a VoiceError naming the voice and its file;
    nothing is rewritten."""
    fresh(tts).add_voice("erin", speech["22k"], REFERENCE_TEXT)
    path = home / "voices" / "erin.safetensors"
    audio = load_reference(speech["22k"]).samples
    rate = tts.voice_library.config.sample_rate
    change = {"nan": dict(audio=torch.where(torch.arange(len(audio)) == 100, float("nan"), audio)),
              "inf": dict(audio=torch.where(torch.arange(len(audio)) == 100, float("inf"), audio)),
              "stereo": dict(audio=torch.stack([audio, audio], 1)),
              "channels first": dict(audio=torch.stack([audio, audio])),
              "int16": dict(audio=(audio * 32767).to(torch.int16)),
              "empty": dict(audio=audio[:0]),
              "short": dict(audio=audio[:rate // 10]),
              "silent": dict(audio=torch.zeros_like(audio)),
              "huge": dict(audio=audio / audio.abs().max() * 1e6),
              "bad rate": dict(sample_rate="5")}[damage]
    _rewrite(path, codec_id="another-codec", **change)
    before = path.read_bytes()
    with pytest.raises(VoiceError, match=r"^voice 'erin' \(.*erin\.safetensors\) was encoded by another codec and its "
                                         rf"audio cannot be re-encoded \(.*{message}.*\): add it again$"):
        fresh(tts).resolve_voice("erin")
    assert path.read_bytes() == before


def test_a_voice_keeps_its_audio_rate_and_another_codec_resamples_it(tts, home, speech, monkeypatch):
    """A voice's audio is at the rate of the codec that made it; re-encoded by a codec of another rate it went to
    the encoder unresampled (sped up or slowed down). The rate is stored with the audio now, and a codec of another
    rate gets the audio resampled to its own; a file without the rate is taken to be at the reading codec's."""
    import dataclasses

    from safetensors import safe_open

    fresh(tts).add_voice("erin", speech["22k"], REFERENCE_TEXT)
    path = home / "voices" / "erin.safetensors"
    library = tts.voice_library
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["sample_rate"] == str(library.config.sample_rate) == "24000"
    seen = []
    monkeypatch.setattr(library.encoder, "encode", lambda wav: seen.append(wav) or torch.zeros(5, 8, dtype=torch.long))
    monkeypatch.setattr(library, "config", dataclasses.replace(library.config, sample_rate=16000))
    _rewrite(path, codec_id="another-codec")
    library.voice("erin")
    assert abs(len(seen[-1]) - len(load_reference(speech["22k"]).samples) * 2 / 3) <= 1
    assert VoiceStore(home).get("erin").sample_rate == 16000
    _rewrite(path, codec_id="another-codec", sample_rate=None)  # written before the rate was kept
    library.voice("erin")
    assert len(seen[-1]) == len(VoiceStore(home).get("erin").audio)


# ----------------------------------------------------------------------------- the transcript's room in the context


def words(tokens: int) -> str:
    """A transcript of exactly `tokens` tokens for the tiny model's tokenizer (each " a" is one)."""
    return " ".join(["a"] * tokens)


def test_a_transcript_that_leaves_the_text_no_room_is_its_own_error(tts):
    """A reference transcript too long for the context was the text's fault ("the prompt (N tokens) plus max_frames
    exceeds the context ...: shorten the text", a 400 naming 'input'), raised by `stream` only once iterated. It is
    a TranscriptError now, when the stream (or session) is made, saying how many tokens the transcript takes and how
    many fit; a transcript of that many tokens leaves room for a few words."""
    from higgs_rt.audio_in import TranscriptError
    from higgs_rt.types import Voice
    from higgs_rt.utterance import MIN_TEXT_TOKENS, Speech

    frames = torch.zeros(100, 8, dtype=torch.long)
    p = SynthesisParams.create(max_frames=3000)
    with pytest.raises(TranscriptError, match=r"^the reference transcript takes 2000 tokens: at most \d+ fit in the "
                                              r"context of 4096 positions beside the reference's 100 audio frames, "
                                              r"max_frames \(3000\) and a few words of text: shorten the transcript "
                                              r"\(or lower max_frames\)$") as e:
        fresh(tts).stream("Hello.", voice=Voice(words(2000), frames), max_frames=3000)
    limit = int(str(e.value).split("at most ")[1].split()[0])
    overhead = len(tts.model.prompt("a", Voice(words(limit), frames), p)) - limit - 100
    assert limit == 4096 - 3000 - 100 - overhead - MIN_TEXT_TOKENS and 900 < limit < 1000
    Speech(tts.model, "Hello there.", Voice(words(limit), frames), p).check()  # a few words fit beside it
    for make in (lambda v: Speech(tts.model, "Hi.", v, p), lambda v: tts.session(v, max_frames=3000),
                 lambda v: tts.stream(["Hi.", "There."], voice=v, max_frames=3000)):
        with pytest.raises(TranscriptError, match=rf"takes {limit + 1} tokens: at most {limit} fit"):
            make(Voice(words(limit + 1), frames))
    long = Voice("a", torch.zeros(1100, 8, dtype=torch.long))  # no transcript would leave room: not its fault
    with pytest.raises(ValueError, match=r"^max_frames \(3000\) leaves no room for any utterance: with its prompt "
                                         r"\(\d+ tokens for one letter and the reference\) it passes the context of "
                                         r"4096 positions; use at most (\d+)$") as e:
        Speech(tts.model, "Hi.", long, p)
    assert not isinstance(e.value, TranscriptError)
    most = int(str(e.value).rsplit(" ", 1)[1])
    Speech(tts.model, "Hello there.", long, SynthesisParams.create(max_frames=most)).check()  # the bound works


def test_cli_names_the_transcript_that_leaves_no_room(random_model, home, speech, capsys, monkeypatch):
    """`speak --ref-text` too long for the context said "shorten the text": exit 2 naming the transcript, and
    --out is left as it was (it held a header-only WAV)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = home.parent / "x.wav"
    out.write_bytes(b"an earlier file")
    args = ["speak", "Hi.", "--model", random_model, "--ref-audio", speech["8k"], "--ref-text", words(2000),
            "--max-frames", "3000", "--out", str(out)]
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("higgs-rt: error: the reference transcript takes 2000 tokens: at most "), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert out.read_bytes() == b"an earlier file"  # refused before any audio: --out as it was, not an empty WAV
