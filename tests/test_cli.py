"""The `higgs-rt` command line, run as a user runs it: a subprocess per call, or in this process (conftest's
`run_main`) for the refusals that come before anything loads, and for the fuzz of every option."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from higgs_rt.engine import TTS
from conftest import run_main


def cli(*args, stdin: str | bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    if isinstance(stdin, bytes):  # as bytes, decoded by the CLI itself
        r = subprocess.run([sys.executable, "-m", "higgs_rt.cli", *map(str, args)], input=stdin, capture_output=True,
                           timeout=300, env={**os.environ, **(env or {})})
        return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())
    return subprocess.run([sys.executable, "-m", "higgs_rt.cli", *map(str, args)], input=stdin, text=True,
                          capture_output=True, timeout=300, env={**os.environ, **(env or {})})


def test_speak_writes_a_wav_equal_to_the_api(random_model, tmp_path):
    out = tmp_path / "hello.wav"
    r = cli("speak", "Hello from the command line.", "--model", random_model, "--out", out, "--seed", 7)
    assert r.returncode == 0, r.stderr
    info = sf.info(out)
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
    data, _ = sf.read(out, dtype="int16")
    tts = TTS(random_model, device="cpu")
    with tts.stream("Hello from the command line.", seed=7) as stream:
        want = np.concatenate(list(stream))
    aligned = sum(f.shape[0] - 9 for f in stream.frames)
    assert data.shape[0] == want.shape[0] == aligned * 960
    from higgs_rt.pcm import to_int16

    np.testing.assert_array_equal(data, to_int16(want))
    assert "first audio" in r.stderr and "RTF" in r.stderr and "ms/frame" in r.stderr and "underruns" in r.stderr
    assert "cold start" not in r.stderr and "import torch" not in r.stderr  # timing lines only with --verbose


STAGES = ("start-up", "import torch", "checks", "import higgs_rt.engine", "TTS()", "model directory", "talker weights", "codec",
          "tokenizer (prompt builder)", "compiled artifacts", "warm-up", "decoder", "prefill", "first audio")


def test_speak_verbose_says_where_the_cold_start_goes(random_model, tmp_path):
    """--verbose: one line per stage of the cold start, in order, nested under TTS(), then the totals; speak
    skips the warm-up utterance; the audio is the same as without."""
    import re

    plain, verbose = tmp_path / "plain.wav", tmp_path / "verbose.wav"
    args = ("speak", "Hello from the command line.", "--model", random_model, "--seed", 3)
    r = cli(*args, "--out", verbose, "--verbose")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if "cold start (--verbose)" in line)
    stage = re.compile(r"^  +(\d+\.\d{3}) +(\d+\.\d{3})  ( *)(\S.*?)(   \[(.*)\])?$")
    rows = []
    for line in lines[head + 1:]:
        m = stage.match(line)
        if not m:
            break
        rows.append((float(m[1]), float(m[2]), len(m[3]) // 2, m[4], m[6] or ""))
    names = [r_[3] for r_ in rows]
    assert [n for n in names if any(n.startswith(s) for s in STAGES)] == names, names
    assert [s for s in STAGES if any(n.startswith(s) for n in names)] == list(STAGES), names
    depth = {n: d for _, _, d, n, _ in rows}
    assert depth["TTS()"] == 0 and depth["talker weights"] == 1 and depth["first audio"] == 0
    detail = {n: d for _, _, _, n, d in rows}
    assert detail["warm-up"].startswith("skipped") and "copied" in detail["talker weights"]
    assert "used in place" in detail["talker weights"]  # the CPU's float32 tensors: the memory map itself
    assert all(b[0] >= a[0] for a, b in zip(rows, rows[1:]))  # chronological
    tts = next(r_ for r_ in rows if r_[3] == "TTS()")
    inside = sum(r_[1] for r_ in rows if r_[2] == 1)
    assert inside <= tts[1] + 0.002
    total = re.search(r"higgs-rt: first audio (\d+\.\d+) s after the process started, (\d+\.\d+) s after import "
                      r"torch returned", r.stderr)
    first = next(r_ for r_ in rows if r_[3] == "first audio")
    assert total and abs(float(total[1]) - (first[0] + first[1])) < 0.01
    assert float(total[2]) < float(total[1])
    assert cli(*args, "--out", plain).returncode == 0
    assert plain.read_bytes() == verbose.read_bytes()


def test_speak_reads_stdin(random_model, tmp_path):
    out = tmp_path / "stdin.wav"
    r = cli("speak", "-", "--model", random_model, "--out", out, stdin="Text from a pipe.")
    assert r.returncode == 0, r.stderr
    assert sf.info(out).frames > 0


@pytest.mark.parametrize("text", [
    "Hello there,\nhow are you today? I am",  # clauses cut across lines
    " ".join(f"word{i}" for i in range(1100)),  # 9 KB without a boundary: stdin's second 4 KB read is more than
    # the room left beside the first read's unfinished clause (it waited for room that never came)
])
def test_speak_stream_text_speaks_stdin_clause_by_clause(random_model, tmp_path, text):
    """`speak - --stream-text` speaks the clauses of stdin (what a text session cuts) with the voice carried
    across them: the WAV equals the API's audio for those segments. The long one passes the session's bound on
    unspoken text, so the CLI waits for room instead of failing."""
    from higgs_rt.params import SynthesisParams
    from higgs_rt.pcm import to_int16
    from higgs_rt.text_split import clause_segments

    out = tmp_path / "streamed.wav"
    r = cli("speak", "-", "--stream-text", "--model", random_model, "--out", out, "--seed", 4, stdin=text)
    assert r.returncode == 0, r.stderr
    tts = TTS(random_model, device="cpu")
    segments = clause_segments(text, tts.model.max_chars(None, SynthesisParams.create()))
    assert len(segments) == (3 if text.startswith("Hello") else 20)
    data, _ = sf.read(out, dtype="int16")
    np.testing.assert_array_equal(data, to_int16(tts.synthesize(segments, seed=4)))
    assert "first audio" in r.stderr


@pytest.mark.parametrize("stdin", ["", " \n\t\u3000\n"])
def test_speak_stream_text_of_an_empty_stdin_is_refused_as_empty_text_is(random_model, tmp_path, stdin):
    """An empty or blank stdin with --stream-text was exit 0, nothing said (and an empty WAV written): it is
    refused as `speak ""` is, and --out, which may hold an earlier file, is left as it was."""
    out = tmp_path / "kept.wav"
    out.write_bytes(b"an earlier file")
    r = cli("speak", "-", "--stream-text", "--model", random_model, "--out", out, stdin=stdin)
    one_line_error(r, 2, "the text to speak is empty")
    assert out.read_bytes() == b"an earlier file"


@pytest.mark.parametrize("stream_text,msg", [([], "the text to speak is not valid UTF-8 (character 6)"),
                                             (["--stream-text"], "stdin is not valid UTF-8 (byte 4107)")])
def test_stdin_that_is_not_utf8_is_refused(random_model, tmp_path, stream_text, msg):
    """Bytes that are not UTF-8 were spoken as U+FFFD (or lone surrogates): refused, with where they are (streamed,
    the bad byte lies past stdin's first 4 KB read, after a character split across the reads)."""
    text = ("x" * 4095 + "é is fine, ").encode() + b"\xff" if stream_text else b"Hello \xe9t\xff\xfe there."
    r = cli("speak", "-", *stream_text, "--model", random_model, "--out", tmp_path / "o.wav", stdin=text)
    one_line_error(r, 2, msg)
    if stream_text:  # what was spoken before the bad byte came stays, as a valid WAV (as after Ctrl-C); the byte
        # may come before any audio, and then --out is not written at all
        out = tmp_path / "o.wav"
        assert not out.exists() or sf.info(out).samplerate == 24000
    else:
        assert not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("args,option", [
    (["make-random-checkpoint", ""], "dir"),  # was Path(''): a checkpoint written into the current directory
    (["speak", "hi", "--out", ""], "--out"),
    (["speak", "hi", "--out", "x.wav", "--model", ""], "--model"),  # was the current directory's model, or none
    (["speak", "hi", "--out", "x.wav", "--codec", " "], "--codec"),
    (["speak", "hi", "--out", "x.wav", "--compiled", ""], "--compiled"),
    (["speak", "hi", "--out", "x.wav", "--ref-audio", "", "--ref-text", "t"], "--ref-audio"),
    (["voice", "add", "v", "--audio", "", "--text", "t"], "--audio"),
    (["voice", "add", "v", "--audio", "x.wav", "--text", "t", "--model", ""], "--model"),  # was: no --model
    (["export", "--out", ""], "--out"),  # was Path(''): packages written into the current directory
    (["client", "--prompts", "", "--output-dir", "o"], "--prompts"),
    (["client", "--prompts", "p.txt", "--output-dir", ""], "--output-dir"),
])
def test_an_empty_path_or_name_is_a_usage_error_not_a_default(args, option, capsys):
    """An empty value (an unset shell variable) was taken as no option or as the current directory."""
    from higgs_rt.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"higgs-rt {' '.join(args[:2] if args[0] == 'voice' else args[:1])}: error: argument "
                          f"{option}: an empty value (see "), err


@pytest.mark.parametrize("args,msg", [
    (["speak", "", "--out", "x.wav"], "the text to speak is empty"),
    (["speak", "--out", "x.wav"], "speak needs TEXT"),
    (["speak", "hi", "--stream-text", "--out", "x.wav"], "--stream-text speaks stdin as it arrives: give - as TEXT"),
    (["speak", "--stream-text", "--out", "x.wav"], "--stream-text speaks stdin as it arrives: give - as TEXT"),
    (["speak", "hi", "--temperature", "-1", "--out", "x.wav"], "--temperature must be in [0.0, 100.0], got -1.0"),
    (["speak", "hi", "--temperature", "inf", "--out", "x.wav"], "--temperature must be a finite number"),
    (["speak", "hi", "--temperature", "nan", "--out", "x.wav"], "--temperature must be a finite number"),
    (["speak", "hi", "--top-k", str(2**31), "--out", "x.wav"], "--top-k must be in [0, 2147483647]"),
    (["speak", "hi", "--top-p", "0", "--out", "x.wav"], "--top-p must be in (0.0, 1.0], got 0.0"),
    (["speak", "hi", "--ras-window", "3", "--out", "x.wav"], "--ras-window must be 0 or 7, got 3"),
    (["speak", "hi", "--seed", "-1", "--out", "x.wav"], "--seed must be in [0, 9223372036854775807]"),
    (["speak", "hi", "--max-frames", "5", "--out", "x.wav"], "--max-frames must be in [9, 65536], got 5"),
    (["speak", "hi", "--seed", "x", "--out", "x.wav"], "argument --seed: invalid int value: 'x'"),
    (["speak", "hi", "--no-such-option", "--out", "x.wav"], "unrecognized arguments: --no-such-option"),
    (["speak", "[SPEAKER0] hi", "--out", "x.wav"], "multi-speaker"),
    (["speak", "hi", "--context", "8", "--out", "x.wav"], "--context must be an integer in [16, 131072], got 8"),
    (["speak", "hi", "--scene", "", "--out", "x.wav"], "--scene is empty"),
    (["speak", "hi", "--scene", " \t ", "--out", "x.wav"], "--scene is empty"),
    (["speak", "hi", "--scene", "[SPEAKER1] a room", "--out", "x.wav"], "--scene contains a [SPEAKERn] tag"),
    (["speak", "hi", "--scene", "x" * 2001, "--out", "x.wav"], "--scene must be at most 2000 characters, got 2001"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, capsys, args, msg):
    """Refused before anything loads: the model does not exist, and that (exit 1) is not what is reported."""
    args = [str(tmp_path / a) if a == "x.wav" else a for a in args]
    r = run_main(capsys, *args, "--model", tmp_path / "no-model")
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.wav").exists()  # nothing written for a call that was refused


def test_missing_model_exits_1_naming_where_it_looked(tmp_path):
    r = cli("speak", "hi", "--model", tmp_path / "nowhere", "--out", tmp_path / "x.wav")
    assert r.returncode == 1 and "no model directory at" in r.stderr and "Traceback" not in r.stderr
    r = cli("speak", "hi", "--model", "nobody/no-such-model", "--out", tmp_path / "x.wav", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("command", ["speak", "voice add"])
def test_compute_cuda_without_cuda_is_one_line(random_model, tmp_path, speech, command):
    args = (["speak", "hi", "--out", tmp_path / "x.wav"] if command == "speak" else
            ["voice", "add", "v", "--audio", speech["22k"], "--text", "Words."])
    r = cli(*args, "--model", random_model, "--compute", "cuda", env={"HIGGS_RT_HOME": str(tmp_path / "home")})
    one_line_error(r, 1, "--compute cuda: ")
    assert "(use 'cpu')" in r.stderr


def test_missing_codec_exits_1(random_model, tmp_path):
    r = cli("speak", "hi", "--model", random_model, "--codec", tmp_path, "--out", tmp_path / "x.wav")
    assert r.returncode == 1 and "no Higgs-Audio v2 codec" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("hub", ["unreachable", "offline"])
def test_model_without_a_codec_fails_at_once_when_the_hub_is_out_of_reach(random_model, tmp_path, hub):
    """No codec anywhere local: one line at once, not huggingface_hub's five retries first (38 s)."""
    import shutil
    import socket

    model = tmp_path / "no-codec"
    shutil.copytree(random_model, model, ignore=shutil.ignore_patterns("audio_tokenizer"))
    with socket.socket() as s:  # a port nobody listens on: the "Hub" refuses at once, without a network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
           "HIGGS_AUDIO_TOKENIZER_PATH": "", "HIGGS_AUDIO_V2_TOKENIZER_PATH": "",
           "HF_HUB_OFFLINE": "1" if hub == "offline" else "0"}
    r = cli("speak", "hi", "--model", model, "--out", tmp_path / "x.wav", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Retry" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no Higgs-Audio v2 codec found" in r.stderr
    why = "HF_HUB_OFFLINE is set" if hub == "offline" else f"http://127.0.0.1:{port} is unreachable"
    assert f"download of bosonai/higgs-audio-v2-tokenizer: skipped, {why}" in r.stderr
    assert f"the model's codec {model / 'audio_tokenizer'}: none" in r.stderr
    assert not (tmp_path / "x.wav").exists()


NO_DEVICE = "higgs-rt: error: no audio output device found: use --out FILE.wav to write a file instead"
NO_PORTAUDIO = ("higgs-rt: error: PortAudio library not found (apt-get install libportaudio2): use --out FILE.wav "
                "to write a file instead")


@pytest.mark.parametrize("machine", ["no-device", "no-libportaudio2"])
def test_no_audio_device_is_a_clear_error(random_model, tmp_path, machine):
    env = {"PULSE_SERVER": "unix:/nonexistent/native", "PULSE_COOKIE": os.devnull}
    if machine == "no-libportaudio2":  # what sounddevice raises at import when the library is absent
        (tmp_path / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
        env["PYTHONPATH"] = str(tmp_path)
    elif os.path.exists("/dev/snd"):
        pytest.skip("this machine has sound cards: PortAudio cannot be made to see no device")
    r = cli("speak", "hi", "--model", random_model, env=env)
    one_line_error(r, 1, "use --out FILE.wav to write a file instead")
    # a machine without libportaudio2 gives the second message for both: each says what to do
    assert r.stderr.strip() in ((NO_DEVICE, NO_PORTAUDIO) if machine == "no-device" else (NO_PORTAUDIO,)), r.stderr


def test_list_devices_and_play(random_model, pulse_device, tmp_path):
    env = {k: os.environ[k] for k in ("PULSE_SERVER", "PULSE_COOKIE", "PULSE_RUNTIME_PATH")}
    r = cli("speak", "--list-devices", env=env)
    assert r.returncode == 0 and pulse_device in r.stdout
    out = tmp_path / "both.wav"
    r = cli("speak", "Played and written.", "--model", random_model, "--device", pulse_device, "--out", out,
            "--play", env=env)
    assert r.returncode == 0, r.stderr
    assert sf.info(out).frames > 0 and "underruns" in r.stderr


def test_make_random_checkpoint_then_speak_as_the_readme_says(tmp_path):
    model = tmp_path / "tiny"
    r = cli("make-random-checkpoint", model)
    assert r.returncode == 0 and "noise, not speech" in r.stdout
    assert r.stderr == "", r.stderr  # no library's progress bar or warning on a quiet success
    r = cli("speak", "Hello from higgs-rt.", "--model", model, "--out", tmp_path / "hello.wav")
    assert r.returncode == 0, r.stderr
    assert sf.info(tmp_path / "hello.wav").samplerate == 24000


def test_make_random_checkpoint_without_the_test_extra_says_what_to_install(tmp_path):
    blocker = tmp_path / "blocked" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed', name='transformers')\n")
    r = cli("make-random-checkpoint", tmp_path / "m", env={"PYTHONPATH": str(blocker.parent)})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "needs transformers: pip install -e '.[test]'" in r.stderr


@pytest.mark.parametrize("flag,what", [("--head-timeout", "no request-head deadline"),
                                       ("--max-connections", "no cap on open connections")])
def test_ray_serve_refuses_serves_connection_bounds_in_one_line_before_ray_is_imported(tmp_path, flag, what):
    """serve bounds its connections (--head-timeout, --max-connections); ray-serve's are Ray Serve's proxy's, where
    neither can be applied: a usage error naming the option and why, not an "unrecognized arguments" pointing at
    `higgs-rt --help`, nor a silent default. Said before ray is imported (here it cannot be)."""
    from higgs_rt.cli import build_parser

    assert getattr(build_parser().parse_args(["serve", flag, "7"]), flag[2:].replace("-", "_")) == 7  # serve's
    blocker = tmp_path / "blocked" / "ray"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed', name='ray')\n")
    path = os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])
    r = cli("ray-serve", "--model", tmp_path / "no-model", flag, "7", env={"PYTHONPATH": path})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"higgs-rt ray-serve: error: argument {flag}: a `serve` option that ray-serve cannot "
                               "apply: its connections are held by Ray Serve's HTTP proxy, which has "
                               f"{what} higgs-rt can set"), r.stderr
    assert r.stderr.endswith("(see higgs-rt ray-serve --help)\n"), r.stderr
    assert flag not in cli("ray-serve", "--help").stdout


@pytest.mark.parametrize("args,command", [
    (["speak", "hi", "--bogus"], "speak"),
    (["speak", "hi", "there"], "speak"),  # a second TEXT
    (["serve", "--bogus", "x"], "serve"),
    (["voice", "add", "v", "--bogus"], "voice add"),
    (["voice", "--bogus", "list"], "voice"),
    (["wyoming", "--bogus"], "wyoming"),
    (["make-random-checkpoint", "d", "--bogus"], "make-random-checkpoint"),
])
def test_a_subcommands_unrecognized_argument_points_at_its_own_help(capsys, args, command):
    """The top-level parser reported them, pointing at `higgs-rt --help`: the subcommand's now, as its other
    errors."""
    from higgs_rt.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    extra = " ".join(args[args.index("--bogus"):args.index("--bogus") + (2 if args[0] == "serve" else 1)]
                     if "--bogus" in args else args[-1:])
    assert e.value.code == 2 and err == (f"higgs-rt {command}: error: unrecognized arguments: {extra} "
                                         f"(see higgs-rt {command} --help)\n"), err


def test_an_unrecognized_argument_before_the_subcommand_is_the_top_levels(capsys):
    from higgs_rt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--bogus", "speak", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "higgs-rt: error: unrecognized arguments: --bogus (see higgs-rt --help)\n", err


@pytest.mark.parametrize("size", ["tiny", "small", "full"])
def test_make_random_checkpoint_sizes_pair_a_talker_with_a_codec_it_fits(size):
    from transformers import HiggsAudioV2TokenizerConfig

    from higgs_rt.config import TalkerConfig
    from higgs_rt.fixtures.codec import CONFIGS
    from higgs_rt.fixtures.talker import transformers_config

    codec = HiggsAudioV2TokenizerConfig(**CONFIGS[size])
    talker = TalkerConfig.from_dict(transformers_config(size))
    assert (codec.num_quantizers, codec.codebook_size) == (talker.num_codebooks, talker.num_codes)


# ---------------------------------------------------------------- outputs: checked before anything loads


def unwritable_dir(tmp_path):
    """A directory where creating a file fails: a read-only one, or /sys where root ignores permissions."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    for candidate in (locked, "/sys"):
        try:
            (Path(candidate) / "probe").touch()
        except OSError:
            return Path(candidate)
        (Path(candidate) / "probe").unlink()
    pytest.skip("no unwritable directory on this machine")


def one_line_error(r, code: int, msg: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("higgs-rt: error: ") and msg in r.stderr, r.stderr


@pytest.mark.parametrize("case,code,msg", [
    ("directory", 2, "is a directory: give a file name"),
    ("suffix", 2, "cannot write .xyz; the suffix names the format: .wav, .flac, .ogg, .mp3"),
    ("no-suffix", 2, "cannot write a file without a suffix"),
    ("missing-parent", 2, "does not exist"),  # exit 1 before, as unwritable and parent-file: a usage error now
    ("unwritable", 2, "cannot write there"),
    ("fifo", 2, "is a FIFO: give a file name"),  # the check's open blocked until a reader came: a hang
    ("parent-file", 2, "file is not a directory"),  # was "the directory ... does not exist"
    ("name-too-long", 2, "File name too long: give another file name"),  # was an OSError's repr of the path, exit 1
    # these passed the check and failed at the first write, once the model had loaded
    ("dangling-link", 2, "dangling.wav is a symbolic link to nowhere/x.wav, which does not exist: give a file name"),
    ("link-to-a-file-s-child", 2, "is a symbolic link to mine/x.wav, which does not exist"),
    ("link-loop", 2, "loop.wav: Too many levels of symbolic links: give another file name"),
])
def test_bad_out_is_one_line_before_the_model_loads(tmp_path, capsys, case, code, msg):
    out = {"directory": tmp_path, "suffix": tmp_path / "x.xyz", "no-suffix": tmp_path / "x",
           "missing-parent": tmp_path / "no" / "x.wav", "fifo": tmp_path / "fifo.wav",
           "parent-file": tmp_path / "file" / "x.wav", "name-too-long": tmp_path / ("x" * 300 + ".wav"),
           "unwritable": unwritable_dir(tmp_path) / "x.wav" if case == "unwritable" else None,
           "dangling-link": tmp_path / "dangling.wav", "link-to-a-file-s-child": tmp_path / "child.wav",
           "link-loop": tmp_path / "loop.wav"}[case]
    made = {"fifo": lambda: os.mkfifo(out), "parent-file": lambda: out.parent.write_text("mine"),
            "dangling-link": lambda: out.symlink_to("nowhere/x.wav"),
            "link-to-a-file-s-child": lambda: ((tmp_path / "mine").write_text("mine"), out.symlink_to("mine/x.wav")),
            "link-loop": lambda: ((tmp_path / "other.wav").symlink_to(out), out.symlink_to(tmp_path / "other.wav"))
            }.get(case, lambda: None)
    made()
    before = sorted(p.name for p in tmp_path.iterdir())
    # the model does not exist: the output is refused first, so nothing was loaded
    r = run_main(capsys, "speak", "hi", "--model", tmp_path / "no-model", "--out", out)
    one_line_error(r, code, msg)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["locked"] if case == "unwritable" else before)


@pytest.mark.parametrize("case,msg", [
    ("dangling-link", "{tmp}/dir is a dangling symbolic link (to nowhere)"),
    ("link-loop", "{tmp}/dir is a loop of symbolic links"),
    ("file", "{tmp}/dir is not a directory"),
    ("missing", "the directory {tmp}/dir does not exist"),  # the outermost missing one, not DIR/sub
    ("read-only", "cannot write there (Permission denied)"),
])
def test_out_in_a_broken_directory_is_a_usage_error_before_the_model_loads(tmp_path, capsys, case, msg):
    """--out DIR/sub/x.wav where DIR cannot hold it: exit 2 naming DIR and why, as the other bad --out are (these
    were exit 1, a dangling link's said "does not exist"); the model does not exist, so nothing was loaded."""
    folder = tmp_path / "dir"
    if case == "dangling-link":
        folder.symlink_to("nowhere")
    elif case == "link-loop":
        (tmp_path / "other").symlink_to(folder)
        folder.symlink_to(tmp_path / "other")
    elif case == "file":
        folder.write_text("mine")
    elif case == "read-only":
        (folder / "sub").mkdir(parents=True)
        folder.joinpath("sub").chmod(0o555)
    out = folder / "sub" / "x.wav"
    if case == "read-only" and os.geteuid() == 0:  # root writes in a read-only directory; /sys refuses it too
        out = unwritable_dir(tmp_path) / "x.wav"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    r = run_main(capsys, "speak", "hi", "--model", tmp_path / "no-model", "--out", out)
    code, err = r.returncode, r.stderr
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith(f"higgs-rt: error: --out {out}: ") and msg.format(tmp=tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("args,option", [
    (["speak", "hi", "--out", "x.wav", "--ref-text", "t", "--ref-audio"], "--ref-audio"),
    (["speak", "hi", "--out", "x.wav", "--model"], "--model"),
    (["speak", "hi", "--out", "x.wav", "--codec"], "--codec"),
    (["speak", "hi", "--out", "x.wav", "--compiled"], "--compiled"),
    (["voice", "add", "v", "--text", "t", "--audio"], "--audio"),
    (["voice", "add", "v", "--text", "t", "--audio", "x.wav", "--model"], "--model"),
    (["voice", "add", "v", "--text", "t", "--audio", "x.wav", "--codec"], "--codec"),
    (["serve", "--model"], "--model"),
    (["wyoming", "--codec"], "--codec"),
    (["export", "--model"], "--model"),
    (["client", "--output-dir", "o", "--prompts"], "--prompts"),
    (["client", "--prompts", "p.txt", "--output-dir", "o", "--ref-text", "t", "--ref-audio"], "--ref-audio"),
    (["client", "--prompts", "p.txt", "--output-dir"], "--output-dir"),
    (["make-random-checkpoint"], "dir"),
])
@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_a_path_option_that_is_a_link_leading_nowhere_is_a_usage_error_naming_it(tmp_path, capsys, monkeypatch,
                                                                                  args, option, link):
    """A dangling link was "No such file or directory" (or a repo id not found on the Hub, for --model) once
    something opened it; now argparse refuses it, one line naming the option, the link and where it leads."""
    monkeypatch.chdir(tmp_path)
    if link == "dangling":
        Path("ref.wav").symlink_to("missing.wav")
        why = "ref.wav: a dangling symbolic link (to missing.wav)"
    else:
        Path("ref.wav").symlink_to("loop.wav")
        Path("loop.wav").symlink_to("ref.wav")
        why = "ref.wav: a loop of symbolic links"
    r = run_main(capsys, *args, "ref.wav")
    code, err = r.returncode, r.stderr
    command = " ".join(args[:2] if args[0] == "voice" else args[:1])
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith(f"higgs-rt {command}: error: argument {option}: {why} (see "), err


def test_a_link_to_something_is_taken_by_the_path_options(tmp_path):
    """The link check refuses only links leading nowhere: a link to a file or a directory is the path given."""
    from higgs_rt.cli_options import file_arg, location_arg, out_file_arg, path_arg

    (tmp_path / "ref.wav").write_bytes(b"RIFF")
    (tmp_path / "model").mkdir()
    (tmp_path / "file-link.wav").symlink_to("ref.wav")
    (tmp_path / "dir-link").symlink_to("model")
    (tmp_path / "dangling.wav").symlink_to("missing.wav")
    assert file_arg(str(tmp_path / "file-link.wav")) == tmp_path / "file-link.wav"
    assert path_arg(str(tmp_path / "dir-link")) == tmp_path / "dir-link"
    assert location_arg(str(tmp_path / "dir-link")) == str(tmp_path / "dir-link")
    assert location_arg("bosonai/higgs-audio-v2-tokenizer") == "bosonai/higgs-audio-v2-tokenizer"  # a repo id
    # --out's links are `check_output`'s: it says where a dangling one leads, and writes through one to a file
    assert out_file_arg(str(tmp_path / "dangling.wav")) == tmp_path / "dangling.wav"


def test_out_through_a_link_to_a_file_writes_the_file(random_model, tmp_path, capsys):
    """A symbolic link to a regular file is taken (as the shell's `>` takes it): the file is written, the link
    stays a link."""
    from higgs_rt.cli import main

    target, link = tmp_path / "target.wav", tmp_path / "link.wav"
    target.write_bytes(b"old")
    link.symlink_to(target.name)
    assert main(["speak", "Hi.", "--model", str(random_model), "--seed", "3", "--max-frames", "20",
                 "--out", str(link)]) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == target.name
    assert sf.info(target).samplerate == 24000 and sf.read(target)[0].size > 0


@pytest.mark.parametrize("args", [["speak", "hi", "--out"], ["speak", "hi", "--ref-text", "hi", "--ref-audio"],
                                  ["voice", "add", "v", "--text", "hi", "--audio"]])
def test_a_file_option_ending_with_a_slash_is_refused(tmp_path, args):
    """Path() drops a trailing slash: `--out a.wav/` wrote a.wav."""
    r = cli(*args, f"{tmp_path / 'a.wav'}/", "--model", tmp_path / "no-model")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "a.wav/ ends with a slash (a directory): give a file name" in r.stderr
    assert not (tmp_path / "a.wav").exists()


def test_the_api_s_output_check_refuses_a_trailing_slash(tmp_path):
    from higgs_rt.audio_file import OutputRefused, check_output

    with pytest.raises(OutputRefused, match="ends with a slash"):
        check_output(f"{tmp_path / 'a.wav'}/")
    assert check_output(tmp_path / "a.wav") == tmp_path / "a.wav"


def test_the_trailing_slash_check_is_one_helper_for_the_cli_and_the_output_check(tmp_path):
    """`audio_file.slash_ended` (the lower layer) says why; the CLI's file options and `check_output` both use it."""
    import argparse

    from higgs_rt.audio_file import OutputRefused, check_output, slash_ended
    from higgs_rt.cli_options import file_arg

    bad = f"{tmp_path / 'a.wav'}/"
    why = slash_ended(bad)
    assert why == f"{bad} ends with a slash (a directory): give a file name"
    assert slash_ended(tmp_path / "a.wav") is None and slash_ended("a.wav") is None
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        file_arg(bad)
    assert str(refused.value) == why
    with pytest.raises(OutputRefused) as refused:
        check_output(bad, "--out")
    assert str(refused.value) == f"--out {why}"


@pytest.mark.parametrize("suffix,fmt,lossless", [(".flac", "FLAC", True), (".ogg", "OGG", False),
                                                  (".mp3", "MP3", False)])
def test_out_writes_the_format_its_suffix_names(random_model, tmp_path, capsys, suffix, fmt, lossless):
    if not sf.check_format(fmt):
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) cannot write {fmt}")
    from higgs_rt.cli import main

    args = ["speak", "Hello in many formats.", "--model", str(random_model), "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "ref.wav")]) == 0
    assert main([*args, "--out", str(tmp_path / f"speech{suffix.upper()}")]) == 0  # the suffix, in any case
    info = sf.info(tmp_path / f"speech{suffix.upper()}")
    want, _ = sf.read(tmp_path / "ref.wav", dtype="int16")
    assert (info.format, info.samplerate, info.channels) == (fmt, 24000, 1)
    got, _ = sf.read(tmp_path / f"speech{suffix.upper()}", dtype="int16")
    if lossless:
        np.testing.assert_array_equal(got, want)
    else:  # lossy codecs pad and delay a little
        assert abs(got.shape[0] - want.shape[0]) <= 2048 + 0.01 * want.shape[0]
    assert f"wrote {tmp_path / f'speech{suffix.upper()}'}" in capsys.readouterr().err


def test_make_random_checkpoint_refuses_to_overwrite_without_force(tmp_path, capsys):
    model = tmp_path / "tiny"
    assert run_main(capsys, "make-random-checkpoint", model, "--seed", 1).returncode == 0
    before = (model / "model.safetensors").read_bytes()
    one_line_error(run_main(capsys, "make-random-checkpoint", model, "--seed", 2), 2,
                   f"{model} already holds a checkpoint: give --force to replace it")
    assert (model / "model.safetensors").read_bytes() == before
    r = run_main(capsys, "make-random-checkpoint", model, "--seed", 2, "--force")
    assert r.returncode == 0, r.stderr
    assert (model / "model.safetensors").read_bytes() != before and (model / "audio_tokenizer/config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no staging or old copies left


def test_make_random_checkpoint_bad_targets_are_one_line(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    one_line_error(run_main(capsys, "make-random-checkpoint", tmp_path / "notes", "--force"), 2,
                   "is not empty and holds no checkpoint")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    one_line_error(run_main(capsys, "make-random-checkpoint", tmp_path / "notes" / "todo.txt"), 2,
                   "exists and is not a directory")
    one_line_error(run_main(capsys, "make-random-checkpoint", unwritable_dir(tmp_path) / "tiny"), 1,
                   "cannot write a checkpoint in")


@pytest.mark.parametrize("seed", [2**70, 2**63, -1])
def test_make_random_checkpoint_seed_out_of_range_is_one_line_naming_it(tmp_path, capsys, seed):
    """A seed past torch's generators was "Overflow when unpacking long long" (exit 2, naming no option), after
    the Talker had been made; -1 was taken. The range is speak's, checked before anything is made."""
    one_line_error(run_main(capsys, "make-random-checkpoint", tmp_path / "tiny", "--seed", seed), 2,
                   f"--seed must be in [0, 9223372036854775807], got {seed}")
    assert list(tmp_path.iterdir()) == []


def test_every_table_option_reaches_the_engine(random_model, tmp_path, monkeypatch):
    """The speak options are the parameter table's, passed through as given (RAS off included: what RAS does
    is tested in test_sampling.py; the tiny model ends too soon for repeats to occur)."""
    from higgs_rt.cli import main
    from higgs_rt.params import PARAMS

    seen = []
    real_stream = TTS.stream

    def stream(self, text, **kw):
        seen.append(kw)
        return real_stream(self, text, **kw)

    monkeypatch.setattr(TTS, "stream", stream)
    values = dict(seed=9, temperature=0.0, top_p=0.5, top_k=3, ras_window=0, ras_max_repeat=5, max_frames=40,
                  scene="A quiet room.")
    assert set(values) == {p.name for p in PARAMS}
    flags = [a for name, v in values.items() for a in ("--" + name.replace("_", "-"), str(v))]
    assert main(["speak", "Options in.", "--model", str(random_model), *flags, "--out", str(tmp_path / "o.wav")]) == 0
    assert seen == [dict(values, voice=None)]


def test_warnings_are_one_line_like_errors(random_model, tmp_path):
    """A --compiled directory without artifacts: one warning line (no source location), then the eager path."""
    r = cli("speak", "Hi.", "--model", random_model, "--out", tmp_path / "hi.wav", "--compiled", tmp_path / "none",
            "--max-frames", "20")
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if line.startswith("higgs-rt:")]
    assert warned == [f"higgs-rt: warning: compiled artifacts in {tmp_path / 'none'} not used (no manifest.json); "
                      "running eager. Re-export them with `higgs-rt export`."], r.stderr
    assert "model.py" not in r.stderr and (tmp_path / "hi.wav").exists()


def test_make_random_checkpoint_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    """safetensors' own error for a failed write (a full disk) is an environment error like an OSError: exit 1,
    one line, and no partial checkpoint left behind."""
    import higgs_rt.fixtures.talker
    from safetensors import SafetensorError

    from higgs_rt.cli import main

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(higgs_rt.fixtures.talker, "save_file", full)
    assert main(["make-random-checkpoint", str(tmp_path / "tiny")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"higgs-rt: error: writing the checkpoint to {tmp_path / 'tiny'} failed: ") and \
        "No space left on device" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def nothing_is_made(monkeypatch):
    """make-random-checkpoint must refuse before making anything: making a Talker fails the test (and on code
    that does not check, keeps it from writing gigabytes)."""
    import higgs_rt.fixtures.talker

    def made(*args, **kwargs):
        raise AssertionError("a Talker was made")

    monkeypatch.setattr(higgs_rt.fixtures.talker, "make_talker", made)


def test_make_random_checkpoint_without_the_disk_for_it_says_what_it_needs_before_making_anything(
        tmp_path, capsys, monkeypatch, nothing_is_made):
    """--size full writes about 11.6 GB: on a disk with 5 GB free it is one line (needed and free), exit 1, and
    nothing is made (nor left: the parent made to ask about its disk is removed)."""
    import shutil

    from higgs_rt.cli import main
    from higgs_rt.fixtures.codec import checkpoint_bytes as codec_bytes
    from higgs_rt.fixtures.talker import checkpoint_bytes as talker_bytes
    from higgs_rt.weights import format_bytes

    asked = []

    def disk_usage(path):
        asked.append(Path(path))
        return shutil._ntuple_diskusage(100 << 30, 95 << 30, 5 << 30)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    target = tmp_path / "new" / "full"
    assert main(["make-random-checkpoint", str(target), "--size", "full"]) == 1
    err = capsys.readouterr().err
    need = talker_bytes("full")[0] + codec_bytes("full")[0] + (64 << 20)
    assert 11e9 < need < 12.5e9  # the 3B Talker in bf16 and the codec in fp32
    assert err == (f"higgs-rt: error: a random full checkpoint needs {format_bytes(need)} of disk but "
                   f"{target.parent} has {format_bytes(5 << 30)} free: choose a directory on a larger disk\n"), err
    assert asked == [target.parent] and list(tmp_path.iterdir()) == []


def test_make_random_checkpoint_without_the_memory_for_it_says_what_it_needs_before_making_anything(
        tmp_path, capsys, monkeypatch, nothing_is_made):
    import shutil

    import higgs_rt.talker
    from higgs_rt.cli import main

    monkeypatch.setattr(higgs_rt.talker, "available_memory", lambda device: 4_000_000_000)
    # The disk check comes first; a CI machine with under 13 GB free must not decide which error this test sees.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
    for layout in ("transformers", "boson"):
        assert main(["make-random-checkpoint", str(tmp_path / "full"), "--size", "full", "--layout", layout]) == 1
        err = capsys.readouterr().err
        assert err.startswith("higgs-rt: error: making a random full checkpoint needs about ") and \
            err.endswith(" GB of memory but 4.00 GB is available\n") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_make_random_checkpoint_room_is_what_it_writes(random_model):
    """The sizes the check computes from the configs are the tensors written: each safetensors file is its
    tensors plus a header, and the whole checkpoint fits the disk it asks for."""
    from higgs_rt.fixtures.checkpoint import DISK_SLACK
    from higgs_rt.fixtures.codec import checkpoint_bytes as codec_bytes
    from higgs_rt.fixtures.talker import checkpoint_bytes as talker_bytes

    for file, (tensors, _) in ((random_model / "model.safetensors", talker_bytes("tiny")),
                               (random_model / "audio_tokenizer" / "model.safetensors", codec_bytes("tiny"))):
        assert tensors < file.stat().st_size < tensors + (1 << 20), file
    written = sum(f.stat().st_size for f in random_model.rglob("*") if f.is_file())
    assert written < talker_bytes("tiny")[0] + codec_bytes("tiny")[0] + DISK_SLACK


@pytest.mark.parametrize("suffix,fmt", [(".wav", "WAV"), (".flac", "FLAC"), (".ogg", "OGG"), (".mp3", "MP3")])
def test_out_on_a_full_disk_is_one_line_in_every_format(random_model, tmp_path, capsys, monkeypatch, suffix, fmt):
    """A write that fails mid-stream (here /dev/full: every write is ENOSPC) is exit 1 and one line naming --out,
    in every format: libsndfile's FLAC encoder reported it without the reason (a traceback), and its Vorbis
    and MP3 encoders ignored it (exit 0 and "wrote ..."). No encoder is left open: an MP3 whose first write
    failed kept its SoundFile, which flushed into the closed file when collected ("Exception ignored" twice)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    if not sf.check_format(fmt):
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) cannot write {fmt}")
    from higgs_rt.cli import main

    out = tmp_path / f"speech{suffix}"
    out.symlink_to("/dev/full")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    assert main(["speak", "Hello on a full disk.", "--model", str(random_model), "--seed", "3", "--out", str(out)]) == 1
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err == f"higgs-rt: error: --out {out}: cannot write there (No space left on device)\n", err


@pytest.mark.parametrize("suffix,fmt", [(".wav", "WAV"), (".flac", "FLAC"), (".ogg", "OGG"), (".mp3", "MP3")])
def test_an_output_without_audio_is_still_a_file_of_its_format(tmp_path, suffix, fmt):
    """Speech that ends before its first audio frame (a short --max-frames): libsndfile wrote a 0-byte .flac or
    .mp3, which no reader takes; such a file holds one silent sample, the others none."""
    from higgs_rt.audio_file import open_output

    if suffix != ".wav" and not sf.check_format(fmt):
        pytest.skip(f"this libsndfile cannot write {fmt}")
    path = tmp_path / f"none{suffix}"
    out = open_output(path, 24000)
    out.close()
    info = sf.info(path)
    assert (info.format, info.samplerate, info.channels) == (fmt, 24000, 1)
    samples, _ = sf.read(path, dtype="int16")
    assert len(samples) == (1 if fmt in ("FLAC", "MP3") else 0) and not samples.any()


def test_stats_of_a_synthesis_without_audio_say_so():
    from higgs_rt.types import StreamStats

    line = StreamStats(frames=9, synthesis_s=0.02).summary()
    assert "RTF n/a (no audio)" in line and "inf" not in line, line


# ---- fuzz: every refusal is one line ---------------------------------------------------------------------------
def _fuzz_value():
    from hypothesis import strategies as st

    hostile = ["", " ", "0", "-1", "1e400", "-inf", "nan", "NaN", "0x10", "1_000", "２", "9" * 40, "1.5", "x" * 300,
               "a/b", "..", "\x7f", "é", "[SPEAKER0] x"]
    numbers = st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr))
    # argparse reads a value starting with "-" (but a negative number) as an option, "--he" as --help
    # no lone surrogates: a shell's argv holds only surrogateescape's, which a real stderr prints and capsys not
    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
    return st.one_of(st.sampled_from(hostile), numbers, text).filter(
        lambda v: not v.startswith("-") or v.lstrip("-")[:1].isdigit() or v.lstrip("-")[:1] in "in")


def _fuzz_option(names: list[str], plausible: dict, value, paths: list[str]):
    """(option, value) pairs: one of `names` with a hostile or random `value`, or as often one of its plausible
    values (a path option's, marked None, are `paths`)."""
    from hypothesis import strategies as st

    return st.sampled_from(names).flatmap(lambda name: st.tuples(st.just(name), st.one_of(
        value, st.sampled_from(plausible[name] or paths))))


# each option's plausible values (None: a path option's, the test's paths)
PLAUSIBLE = {"--seed": ["0", "7"], "--temperature": ["0", "0.7"], "--top-p": ["0.9", "1"], "--top-k": ["0", "50"],
             "--ras-window": ["0", "7"], "--ras-max-repeat": ["2"], "--max-frames": ["9", "100"], "--context": ["512"],
             "--scene": ["A quiet room."], "--voice": ["nobody"], "--dtype": ["fp32", "bf16"],
             "--compute": ["cpu", "auto"], "--device": ["0", "pulse"], "--ref-text": ["Hello there."],
             "--ref-audio": None, "--out": None, "--compiled": None, "--codec": None, "--audio": None,
             "--text": ["Hi."]}
SPEAK_OPTIONS = [name for name in PLAUSIBLE if name not in ("--audio", "--text")]
SPEAK_FLAGS = ["--play", "--stream-text", "--verbose"]


def test_fuzz_speak_and_voice_add_arguments_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Hostile, random and plausible values for the options of `speak` (--out x.wav unless one is drawn) and `voice
    add`, the model missing (nothing loads): exit 1 or 2 with one line on stderr, never a traceback, and no file
    written (derandomized hypothesis, 300 command lines)."""
    from hypothesis import strategies as st

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a value read as a Hugging Face repo id is not looked up online
    (tmp_path / "dir").mkdir()
    (tmp_path / "junk.wav").write_bytes(b"RIFF" + b"\x00" * 40)
    paths = [str(tmp_path / p) for p in ("x.wav", "x.flac", "x.xyz", "dir", "junk.wav", "none/x.wav")] + ["/dev/null"]
    value = _fuzz_value()
    argv = st.one_of(
        st.tuples(st.just(["speak", "--out", paths[0]]), value.filter(lambda v: v != "-").map(lambda v: [v]),
                  st.lists(_fuzz_option(SPEAK_OPTIONS, PLAUSIBLE, value, paths), max_size=4),
                  st.lists(st.sampled_from(SPEAK_FLAGS), max_size=2)),
        st.tuples(st.just(["voice", "add"]), value.map(lambda v: [v]),
                  st.lists(_fuzz_option(["--audio", "--text", "--compute", "--codec"], PLAUSIBLE, value, paths),
                           max_size=3), st.just([])))
    refused_in_one_line(argv, tmp_path, capsys)


def refused_in_one_line(argv, tmp_path: Path, capsys) -> None:
    """Each command line `argv` draws (command, positionals, (option, value) pairs, flags), run in process with a
    missing model: exit 1 or 2, one line on stderr, no traceback, nothing new in tmp_path."""
    from hypothesis import HealthCheck, given, settings

    before = sorted(p.name for p in tmp_path.iterdir())

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
    @given(argv)
    def refused(parts):
        command, positional, options, flags = parts
        args = [*command, *positional, *(x for pair in options for x in pair), *flags,
                "--model", str(tmp_path / "no-model")]
        r = run_main(capsys, *args)
        assert r.returncode in (1, 2), (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("higgs-rt") and ": error: " in r.stderr, (args, r.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args

    refused()


SERVE_PLAUSIBLE = {"--slots": ["1", "4"], "--queue": ["0", "8"], "--prefill-tokens": ["512"], "--chunk": ["4"],
                   "--max-buffered-s": ["30"], "--api-key": ["k" * 16], "--allowed-hosts": ["example.com"],
                   "--allow-origin": ["https://example.com"], "--max-input-chars": ["4096"],
                   "--body-timeout": ["30"], "--ref-cache-mb": ["64"], "--max-voices": ["10"],
                   "--max-ws-connections": ["4"], "--ws-idle-timeout": ["60"], "--shutdown-timeout": ["5"],
                   "--head-timeout": ["10"], "--max-connections": ["64"], "--log-level": ["info", "debug"],
                   "--context": ["512"], "--dtype": ["fp32"], "--compute": ["cpu"], "--compiled": None,
                   "--codec": None}


def test_fuzz_serve_options_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """`serve` with hostile, random and plausible values for its options (on a free loopback port, or a host and
    port that cannot be: no name is looked up), the model missing: refused in one line before anything serves."""
    from hypothesis import strategies as st

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HIGGS_RT_API_KEY", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (tmp_path / "dir").mkdir()
    paths = [str(tmp_path / "dir"), str(tmp_path / "none")]
    value = _fuzz_value()
    hosts = ["127.0.0.1", "::1", "0.0.0.0", "::"]  # beyond loopback: refused without --api-key or --no-auth
    ports = value.filter(lambda v: not (v.isdigit() and 0 < int(v) < 65536))  # no port of the machine's taken
    address = st.tuples(st.sampled_from(hosts), st.one_of(*[st.just(port)] * 3, ports)).map(
        lambda where: ["--host", where[0], "--port", where[1]])
    argv = st.tuples(st.just(["serve"]), address,
                     st.lists(_fuzz_option(list(SERVE_PLAUSIBLE), SERVE_PLAUSIBLE, value, paths), max_size=4),
                     st.lists(st.sampled_from(["--benchmark", "--no-auth", "--verbose"]), max_size=2))
    refused_in_one_line(argv, tmp_path, capsys)
