"""What an export promises a host: the C++ host (examples/host) speaks from the packages with no Python, with
the codes of the Python exported path; the manifest records the decode-step state, no KV-cache copy and the
runtime's choice for every package; the runtime honours them.

One export of the tiny model (conftest's `exported_model`, shared with test_export.py) and one build of the host
(CMake against the installed libtorch) serve the whole file. CI has g++ and cmake, so there a missing one fails
the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from higgs_rt.compiled import (CODEC, MANIFEST, PREFILL, CodecRunner, CompiledArtifactsWarning, PrefillRunner,
                               StepRunner, misaligned_state, named_tensors, state_spec, step_file)
from higgs_rt.engine import TTS
from higgs_rt.generate import Decoder, generate
from higgs_rt.ops.library import library_path
from higgs_rt.pcm import to_int16
from higgs_rt.sampling import SamplingParams
from higgs_rt.torch_compat import load_package
from tools.export.host import WEIGHTS
from conftest import EXPORT_CONTEXT

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = EXPORT_CONTEXT
TEXT = "The host speaks from the exported packages."
MAX_FRAMES = 60


@pytest.fixture(scope="module")
def exported(exported_model) -> Path:
    """The model dir with its artifacts in compiled/ (conftest's export, shared with test_export.py)."""
    return exported_model.model


@pytest.fixture(scope="module")
def artifacts(exported):
    return exported / "compiled"


@pytest.fixture(scope="module")
def manifest(artifacts):
    return json.loads((artifacts / MANIFEST).read_text())


def forced(artifacts: Path, tmp_path: Path, **faster: bool) -> Path:
    """A copy of the artifacts whose manifest says the probe timed these packages so (by file stem)."""
    out = tmp_path / "forced"
    shutil.copytree(artifacts, out, ignore=shutil.ignore_patterns(WEIGHTS))
    manifest = json.loads((out / MANIFEST).read_text())
    for stem, value in faster.items():
        manifest["artifacts"][f"{stem}.pt2"]["faster_than_eager"] = value
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def load(model: Path, compiled: Path) -> tuple[TTS, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tts = TTS(model, device="cpu", context=CONTEXT, compiled=compiled)
        tts.decoder  # its step binds with the slot
    return tts, [str(w.message) for w in caught if issubclass(w.category, CompiledArtifactsWarning)]


# ---------------------------------------------------------------------------------------------- the C++ host


def _unavailable(reason: str):
    if os.environ.get("CI"):  # CI installs g++ and cmake (.ci/run): there the host must build
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def host(tmp_path_factory) -> Path:
    """examples/host built once per session against this environment's torch."""
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which(os.environ.get("CXX", "g++")) is None:
        _unavailable("the C++ host needs cmake and a C++ compiler (pip install cmake; apt-get install g++)")
    build = tmp_path_factory.mktemp("host-build")
    configure = [cmake, "-S", str(ROOT / "examples"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}"]
    for cmd in (configure, [cmake, "--build", str(build), "--parallel", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return build / "higgs_rt_host"


def run_host(host: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(host), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("seed", [3, 11])
def test_the_cpp_host_speaks_the_codes_of_the_python_exported_path(exported, artifacts, host, tmp_path, seed):
    tts, warned = load(exported, forced(artifacts, tmp_path, prefill=True, step_b1=True, codec=True))
    assert not warned and isinstance(tts.decoder.step_fn, StepRunner)
    prompt = tts.prompts.tts(TEXT)
    want = generate(tts.decoder, prompt, SamplingParams(seed=seed), max_frames=MAX_FRAMES).frames

    ids = tmp_path / "prompt.txt"
    ids.write_text(" ".join(map(str, prompt.ids.tolist())) + "\n")
    proc = run_host(host, "--artifacts", artifacts, "--ids", ids, "--out", tmp_path / "host.wav", "--codes",
                    tmp_path / "codes.txt", "--seed", seed, "--max-frames", MAX_FRAMES, "--ops", library_path())
    got = torch.tensor(np.loadtxt(tmp_path / "codes.txt", dtype=np.int64, ndmin=2))
    assert got.shape == want.shape and torch.equal(got, want)
    print(proc.stderr.strip())

    aligned = tts.codec.postprocess(want)
    assert aligned.shape[0] >= 2
    speech = tts.codec.decode(aligned[None])[0]  # the codec package
    pcm, rate = sf.read(tmp_path / "host.wav", dtype="int16")
    assert rate == tts.sample_rate and pcm.shape == (aligned.shape[0] * tts.codec.hop_length,)
    assert np.abs(pcm.astype(int) - to_int16(speech).astype(int)).max() <= 1  # 16-bit rounding of equal audio
    assert np.abs(pcm).max() > 0


@pytest.mark.parametrize("ids, error", [
    ("1 2 x", "--ids needs an integer >= 0, got 'x'"),
    ("7", f"--ids: the prompt has 1 tokens; the exported prefill takes 2 to {CONTEXT}"),
    ("1 999999999", "--ids: token id 999999999 is outside the vocabulary"),
], ids=["not-a-number", "too-short", "out-of-vocabulary"])
def test_the_cpp_host_refuses_bad_prompts_in_one_line(artifacts, host, tmp_path, ids, error):
    (tmp_path / "ids.txt").write_text(ids)
    proc = run_host(host, "--artifacts", artifacts, "--ids", tmp_path / "ids.txt", "--out", tmp_path / "x.wav",
                    "--ops", library_path(), check=False)
    assert proc.returncode == 1 and not (tmp_path / "x.wav").exists()
    assert proc.stderr.startswith(f"higgs_rt_host: error: {error}") and proc.stderr.count("\n") == 1


def test_the_cpp_host_names_what_is_missing(host, tmp_path):
    (tmp_path / "ids.txt").write_text("1 2 3")
    proc = run_host(host, "--artifacts", tmp_path, "--ids", tmp_path / "ids.txt", "--out", tmp_path / "x.wav",
                    "--ops", library_path(), check=False)
    assert proc.returncode == 1 and proc.stderr == f"higgs_rt_host: error: cannot read {tmp_path}/weights.pt\n"
    proc = run_host(host, "--ids", "a", check=False)
    assert proc.returncode == 1 and proc.stderr == ("higgs_rt_host: error: --artifacts, --ids and --out are "
                                                    "required\n")


def test_the_cpp_host_refuses_weights_with_nan_or_inf_naming_the_tensor(artifacts, host, tmp_path):
    """The Python loader refuses a weight holding NaN or inf (weights.FiniteCheck); the host read weights.pt
    without that check and spoke noise from it."""
    poisoned = tmp_path / "poisoned"
    shutil.copytree(artifacts, poisoned)
    saved = torch.load(poisoned / WEIGHTS)
    names = sorted(n for n, t in saved["tensors"].items() if t.is_floating_point() and t.numel() > 1)
    first, second = names[len(names) // 2], names[-1]
    saved["tensors"][first].view(-1)[1] = float("nan")
    saved["tensors"][second].view(-1)[0] = float("-inf")
    torch.save(saved, poisoned / WEIGHTS)
    (tmp_path / "ids.txt").write_text("1 2 3")
    proc = run_host(host, "--artifacts", poisoned, "--ids", tmp_path / "ids.txt", "--out", tmp_path / "x.wav",
                    "--ops", library_path(), check=False)
    floating = sum(t.is_floating_point() and t.numel() > 0 for t in saved["tensors"].values())
    assert proc.returncode == 1 and not (tmp_path / "x.wav").exists()
    assert proc.stderr == (f"higgs_rt_host: error: weights.pt: {first} holds NaN or infinite values (and 1 more of "
                           f"the {floating} tensors): the file is corrupt (export it again)\n"), proc.stderr


def test_the_weights_file_holds_what_every_package_binds(exported, artifacts, manifest):
    saved = torch.load(artifacts / WEIGHTS)
    assert manifest["host_weights"] == {"file": WEIGHTS, "bytes": (artifacts / WEIGHTS).stat().st_size,
                                        "tensors": len(saved["tensors"])}
    tts, _ = load(exported, False)
    loaded = {**named_tensors(tts.talker, "talker"), **named_tensors(tts.codec, "codec")}
    assert set(saved["tensors"]) == set(loaded)
    for name, tensor in saved["tensors"].items():
        assert torch.equal(tensor, loaded[name]), name
    for file in (PREFILL, step_file(1), CODEC):
        assert set(load_package(artifacts / file, -1).constant_names()) <= set(saved["tensors"])
    host = saved["host"]
    assert host["state"] == manifest["artifacts"][step_file(1)]["state"] and host["batch_sizes"] == [1]
    assert host["slot_reset"]["sampler.frame"].item() == 1 and host["slot_reset"]["sampler.eos_start"].item() == -1
    assert not host["slot_reset"]["sampler.done"].item()


# ---------------------------------------------------------------------------------------------- the manifest


def test_the_manifest_records_the_state_and_no_cache_copy(exported, manifest):
    entry = manifest["artifacts"][step_file(1)]
    tts, _ = load(exported, False)
    assert entry["state"] == state_spec(Decoder(tts.talker, batch=1, context=CONTEXT))
    assert entry["cache_copies"] == []


def test_a_decoder_state_unlike_the_exported_one_steps_eagerly_with_one_warning(exported, artifacts, tmp_path):
    stale = forced(artifacts, tmp_path, step_b1=True)
    manifest = json.loads((stale / MANIFEST).read_text())
    manifest["artifacts"][step_file(1)]["state"][4][3] = True  # sampler.seeds declared written
    (stale / MANIFEST).write_text(json.dumps(manifest))
    tts, warned = load(exported, stale)
    assert warned == [f"higgs-rt: compiled artifacts in {stale} not used (step_b1.pt2 was exported for another "
                      "decoder state (names, shapes or dtypes)); running eager. Re-export them with `higgs-rt "
                      "export`."]
    assert not tts.decoder.uses_exported_step and isinstance(tts.decoder.prefill_fn, PrefillRunner)


def test_a_misaligned_state_steps_eagerly_with_one_warning(exported, artifacts, tmp_path):
    """A GPU package would clone a misaligned input (its alignment guard) and write the clone, not the decoder's
    state; the runtime never binds such state (CPU packages have no guard; the rule is the same everywhere)."""
    tts, _ = load(exported, forced(artifacts, tmp_path, step_b1=True))
    decoder = Decoder(tts.talker, batch=1, context=CONTEXT)
    assert misaligned_state(decoder) == [] and isinstance(tts.compiled.step_for(decoder), StepRunner)
    k = decoder.cache.k
    decoder.cache.k = torch.zeros(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # 4 bytes off
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tts.compiled.step_for(decoder) is None
    assert [str(w.message) for w in caught] == [
        f"higgs-rt: compiled artifacts in {tmp_path / 'forced'} not used (step_b1.pt2 needs its state 16-byte "
        "aligned; cache.k is not); running eager. Re-export them with `higgs-rt export`."]


def test_every_package_has_the_probes_timing_and_the_runtimes_choice(manifest):
    for name, key in ((PREFILL, "probe_ms_per_call"), (step_file(1), "probe_ms_per_step"),
                      (CODEC, "probe_ms_per_call")):
        entry = manifest["artifacts"][name]
        assert set(entry[key]) == {"exported", "eager"} and min(entry[key].values()) > 0
        assert entry["faster_than_eager"] == (entry[key]["exported"] < entry[key]["eager"])


@pytest.mark.parametrize("prefill, codec", [(False, True), (True, False), (False, False)])
def test_the_runtime_runs_eager_what_the_probe_timed_slower(exported, artifacts, tmp_path, prefill, codec):
    tts, warned = load(exported, forced(artifacts, tmp_path, prefill=prefill, step_b1=True, codec=codec))
    assert not warned
    assert isinstance(tts.decoder.prefill_fn, PrefillRunner) == prefill
    assert isinstance(tts.codec.exported, CodecRunner) == codec
    assert isinstance(tts.decoder.step_fn, StepRunner)
    eager, _ = load(exported, False)
    streams = [engine.stream(TEXT, seed=2, max_frames=40) for engine in (tts, eager)]
    for stream in streams:
        with stream:
            list(stream)
    assert torch.equal(streams[0].frames[0], streams[1].frames[0])


def test_export_prints_the_runtimes_choice(exported_model, manifest):
    lines = exported_model.printed.splitlines()
    for name, unit in ((PREFILL, "call"), (step_file(1), "step"), (CODEC, "call")):
        entry = manifest["artifacts"][name]
        timed = entry[f"probe_ms_per_{unit}"]
        verdict = "the runtime uses it" if entry["faster_than_eager"] else "slower: the runtime runs eager"
        assert f"  {name}: {timed['exported']:.2f} ms/{unit}, eager {timed['eager']:.2f}: {verdict}" in lines
