"""Shared pytest fixtures: tiny random checkpoints, built once per session.

Talker fixtures go through the oracle: the fixture tool writes a random checkpoint, transformers loads it
(strictly: no missing or unexpected keys) and `save_pretrained` writes the directory higgs-rt then loads.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from higgs_rt.resample import install_torchaudio_standin

# transformers decides once whether torchaudio exists: the stand-in must be in place before its first look
install_torchaudio_standin()

TINY_TALKERS = ("tiny", "tiny-mha")
SR = 24000


def _oracle_talker(src: Path, out: Path):
    from transformers import HiggsAudioV2ForConditionalGeneration
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model, info = HiggsAudioV2ForConditionalGeneration.from_pretrained(src, output_loading_info=True)
    assert not any(info.values()), f"the fixture is not in transformers' layout: {info}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return model.eval()


@pytest.fixture(scope="session")
def talker_dirs(tmp_path_factory):
    """size -> (transformers dir written by save_pretrained, Boson-layout dir of the same weights, oracle)."""
    from higgs_rt.fixtures.talker import make_talker

    root = tmp_path_factory.mktemp("talkers")
    out = {}
    for i, size in enumerate(TINY_TALKERS):
        src = make_talker(root / f"{size}-src", size, seed=10 + i)
        oracle = _oracle_talker(src, root / f"{size}-hf")
        boson = make_talker(root / f"{size}-boson", size, layout="boson", seed=10 + i)
        out[size] = (root / f"{size}-hf", boson, oracle)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(talker_dirs):
    return talker_dirs["tiny"][0]


@pytest.fixture(scope="session", autouse=True)
def _scratch_homes(tmp_path_factory):
    """higgs-rt's own files (cloned voices, tokenizer caches) and torch.compile's cache go to the run's temp dir,
    never the user's, and leave with it (the inductor cache in /tmp otherwise grows by every run's kernels)."""
    names = ("HIGGS_RT_HOME", "TORCHINDUCTOR_CACHE_DIR")
    old = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_codec_dirs(tmp_path_factory):
    """A tiny random codec (every tensor random, seed 0) in both checkpoint layouts, from the same weights."""
    from higgs_rt.fixtures.codec import make_codec

    root = tmp_path_factory.mktemp("codec")
    return {layout: make_codec(root / layout, size="tiny", layout=layout, seed=0)
            for layout in ("transformers", "boson")}


@pytest.fixture(scope="session")
def tiny_codec(tiny_codec_dirs):
    """The tiny random codec, loaded (CPU, fp32)."""
    from higgs_rt.codec import load_codec

    return load_codec(tiny_codec_dirs["transformers"])


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """A tiny random model with its codec (audio_tokenizer/), as `higgs-rt make-random-checkpoint` writes it."""
    from higgs_rt.cli import main

    out = tmp_path_factory.mktemp("random-model") / "tiny"
    assert main(["make-random-checkpoint", str(out), "--seed", "5"]) == 0
    return out


EXPORT_CONTEXT = 512


@pytest.fixture(scope="session")
def exported_model(random_model, tmp_path_factory):
    """`higgs-rt export` of a copy of the tiny model (batch 1, context EXPORT_CONTEXT, two worker processes):
    `model` holds its artifacts in compiled/, where the runtime finds them; `printed` is the export's stderr,
    `logs` its workers' logs, `seconds` its time. AOTInductor compiles C++ for about a minute on two cores, so
    test_export.py and test_export_host.py share this one; a test that changes the artifacts changes a copy."""
    from higgs_rt.cli import main

    model = tmp_path_factory.mktemp("exported") / "model"
    shutil.copytree(random_model, model)
    logs, printed = model.parent / "worker-logs", io.StringIO()
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(printed):
        mp.setenv("HIGGS_RT_EXPORT_LOGS", str(logs))
        assert main(["export", "--model", str(model), "--compute", "cpu", "--context", str(EXPORT_CONTEXT),
                     "--batch", "1", "--jobs", "2"]) == 0, printed.getvalue()
    return SimpleNamespace(model=model, printed=printed.getvalue(), logs=logs, seconds=time.perf_counter() - start)


# ---------------------------------------------------------------- a real PortAudio output: PulseAudio null sink


def _unavailable(reason: str):
    """CI installs the audio stack (.ci/run), so there a missing piece is a failure, not a skip."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _rescan(sd) -> None:
    """PortAudio lists devices once, at init: start it again after the audio setup changed."""
    sd._terminate()
    sd._initialize()


def _wait_for_flowing_callbacks(sd, device: str, timeout: float = 10.0) -> bool:
    calls = []
    flowing = threading.Event()

    def callback(outdata, frames, time_info, status):
        outdata.fill(0)
        calls.append(frames)
        if len(calls) >= 10:
            flowing.set()

    with sd.OutputStream(SR, 480, device, 1, "float32", callback=callback):
        return flowing.wait(timeout)


@pytest.fixture(scope="session")
def pulse_device(tmp_path_factory):
    """Name of a PortAudio output device that plays into a private PulseAudio null sink."""
    exe, parec = shutil.which("pulseaudio"), shutil.which("parec")
    if exe is None or parec is None:
        _unavailable("pulseaudio/parec not installed (apt-get install pulseaudio pulseaudio-utils libasound2-plugins)")
    run = tmp_path_factory.mktemp("pulse")
    sock = run / "native"
    env = {**os.environ, "HOME": str(run), "XDG_RUNTIME_DIR": str(run), "XDG_CONFIG_HOME": str(run),
           "PULSE_SERVER": f"unix:{sock}", "PULSE_COOKIE": str(run / "cookie"), "PULSE_RUNTIME_PATH": str(run)}
    quiet = dict(env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # the sink is loaded first, so once the socket exists the sink does too
    server = subprocess.Popen(
        [exe, "-n", "--daemonize=no", "--exit-idle-time=-1", "--use-pid-file=no", "--log-level=error",
         "-L", "module-null-sink sink_name=higgs_rt_test rate=24000 channels=1",
         "-L", f"module-native-protocol-unix socket={sock} auth-anonymous=1"],
        **quiet,
    )
    procs = [server]
    mp = pytest.MonkeyPatch()
    try:
        deadline = time.monotonic() + 15
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not sock.exists():
            server.kill()
            _unavailable(f"pulseaudio did not start: {server.communicate()[1].decode(errors='replace')[-500:]}")
        # An idle null sink renders 2 s blocks, so a new stream can wait up to 2 s for its first
        # period; a low-latency recorder on its monitor keeps it ticking every 10 ms instead.
        procs.append(subprocess.Popen([parec, "--latency-msec=10", "-d", "higgs_rt_test.monitor"], **quiet))
        for name in ("PULSE_SERVER", "PULSE_COOKIE", "PULSE_RUNTIME_PATH"):
            mp.setenv(name, env[name])
        try:
            import sounddevice as sd
        except (ImportError, OSError) as e:
            _unavailable(f"sounddevice/PortAudio unavailable: {e}")
        _rescan(sd)
        if "pulse" not in [d["name"] for d in sd.query_devices()]:
            _unavailable("PortAudio sees no 'pulse' device (apt-get install libasound2-plugins)")
        assert _wait_for_flowing_callbacks(sd, "pulse"), "the PulseAudio null sink never consumed audio"
        yield "pulse"
    finally:
        mp.undo()
        for proc in reversed(procs):
            proc.terminate()
            proc.communicate(timeout=10)
        if "sounddevice" in sys.modules:
            _rescan(sys.modules["sounddevice"])


# ---------------------------------------------------------------- real speech references: espeak-ng + sox

REFERENCE_TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="session")
def speech(tmp_path_factory):
    """One spoken sentence (espeak-ng, 22.05 kHz mono int16 WAV) and variants: 8 kHz and 48 kHz WAV and 16 kHz
    FLAC (sox), and a stereo float WAV whose channels differ (the right one is the left, halved and delayed)."""
    import numpy as np
    import soundfile as sf

    espeak, sox = shutil.which("espeak-ng"), shutil.which("sox")
    if espeak is None or sox is None:
        _unavailable("espeak-ng and sox render the reference speech (apt-get install espeak-ng sox)")
    root = tmp_path_factory.mktemp("speech")
    out = {"22k": root / "ref.wav"}
    subprocess.run([espeak, "-w", str(out["22k"]), REFERENCE_TEXT], check=True, capture_output=True)
    for name, file, rate in (("8k", "ref8k.wav", 8000), ("48k", "ref48k.wav", 48000), ("flac", "ref.flac", 16000)):
        out[name] = root / file
        subprocess.run([sox, str(out["22k"]), "-r", str(rate), str(out[name])], check=True, capture_output=True)
    mono, rate = sf.read(out["22k"], dtype="float32")
    out["stereo"] = root / "stereo.wav"
    sf.write(out["stereo"], np.stack([mono, 0.5 * np.roll(mono, 40)], 1), rate, subtype="FLOAT")
    return out


def dribble(sock, data: bytes, every_s: float = 0.2) -> threading.Thread:
    """Send data a byte every `every_s` seconds on a thread (a slowloris client) until done or the server closes
    the socket."""
    def send() -> None:
        try:
            for byte in data:
                sock.send(bytes([byte]))
                time.sleep(every_s)
        except OSError:  # closed by the server
            pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def read_all(sock) -> bytes:
    """All the server sends until it closes the socket. A reset ends it like a close: a server that closes with a
    client's bytes unread (a slowloris cut off by a 408) resets the connection after its answer, and the reset
    reaches the reader as ConnectionResetError once the answer is read."""
    data = b""
    try:
        while piece := sock.recv(65536):
            data += piece
    except OSError:
        pass
    return data


def run_main(capsys, *args) -> subprocess.CompletedProcess:
    """The CLI in this process, as the console script calls it: its exit status and output. For refusals that come
    before anything loads: a subprocess would spend seconds importing torch for each."""
    from higgs_rt.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll condition() until it holds (True) or timeout seconds pass (False). Generous by default: only a hang
    gets near it on a loaded 2-core CI machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


_SWITCHED_RUN = """
import importlib, sys, torch
module, name = sys.argv[1].rsplit(".", 1)
op = getattr(importlib.import_module(module), name)
cases = torch.load(sys.argv[2])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    out = [op(*case) for case in cases]
    torch.cuda.synchronize()
torch.save((out, [e.name for e in prof.events() if sys.argv[4] in e.name]), sys.argv[3])
"""


def run_switched(op: str, cases: list, kernel: str, tmp_path: Path, variable: str,
                 values: tuple[str | None, ...]) -> list[tuple[list, list[str]]]:
    """op ("module.name") on each case's arguments, once per value, each in a fresh process whose environment has
    `variable` set to that value (or removed: None), since the kernels read their switches once: per value, the
    outputs and the names of the CUDA kernels containing `kernel` that ran (which prove the switch took)."""
    cases_path = tmp_path / "cases.pt"
    torch.save(cases, cases_path)
    runs = []
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != variable}
        if value is not None:
            env[variable] = value
        out = tmp_path / f"out_{value}.pt"
        subprocess.run([sys.executable, "-c", _SWITCHED_RUN, op, str(cases_path), str(out), kernel], env=env,
                       check=True, timeout=600)
        runs.append(torch.load(out))
    return runs
