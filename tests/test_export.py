"""Exported artifacts (tools/export, higgs_rt.compiled) on the CPU with the tiny model: the same codes and audio
as the eager path; stale, corrupt or missing artifacts fall back to it with one warning.

One export (batch 1, conftest's `exported_model`) serves the whole file and test_export_host.py: AOTInductor
compiles C++, about 90 s on two cores.
"""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from higgs_rt.cli import main
from higgs_rt.cli_options import load_tts
from higgs_rt.codec import delay_pattern
from higgs_rt.compiled import (MANIFEST, CHOICE_ENV, CodecRunner, CompiledArtifactsWarning, PrefillRunner,
                               StepRunner, exported_choice, step_state, use_exported)
from higgs_rt.engine import TTS, Voice
from higgs_rt.generate import Decoder
from higgs_rt.sampling import SamplingParams
from tools.export import ExportProbeError
from tools.export.probe import run_probe
from conftest import EXPORT_CONTEXT

CONTEXT = EXPORT_CONTEXT
TEXT = "Hello there. This is a test of a longer sentence."  # two utterances at max_frames=80: the second is
# prompted with the first's codes, so the prefill runs with and without audio frames


@pytest.fixture(scope="module", autouse=True)
def exported_step_always():
    """The runtime keeps an exported step only where the export's probe timed it faster than the eager one, and
    a loaded machine can time it either way: these tests fix the choice, and the choosing is tested apart
    (test_step_choice_*, test_the_probe_times_each_package_and_auto_follows_its_verdict)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHOICE_ENV, "always")
        yield


@pytest.fixture(scope="module")
def exported(exported_model):
    """A copy of the tiny model with its artifacts in MODEL/compiled/, where the runtime finds them (conftest)."""
    return exported_model.model  # the runtime takes every package here, whatever was timed: $HIGGS_RT_EXPORTED=always


def test_an_export_in_two_workers_logs_each_package_apart(exported_model):
    # two worker processes (`--jobs 2`: the default on a machine of 16+ cores); the README's export runs in process
    print(f"export took {exported_model.seconds:.1f} s")
    logs = exported_model.logs  # kept where $HIGGS_RT_EXPORT_LOGS says (the GPU probe reads them)
    assert sorted(p.name for p in logs.iterdir()) == ["codec.log", "prefill.log", "step_b1.log"]
    assert "step_b1.pt2: compiling" in (logs / "step_b1.log").read_text()
    manifest = json.loads((exported_model.model / "compiled" / MANIFEST).read_text())
    assert manifest["jobs"] == 2 and manifest["compile_s"] > 0
    assert list(manifest["artifacts"]) == ["prefill.pt2", "step_b1.pt2", "codec.pt2"]


@pytest.fixture(scope="module")
def eager(exported):
    return TTS(exported, device="cpu", context=CONTEXT, compiled=False)


def load(model, **kw) -> tuple[TTS, list[warnings.WarningMessage]]:
    """TTS with its slot made, as `speak` loads it: the warnings of the artifacts and of binding the step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tts = TTS(model, device="cpu", context=CONTEXT, **kw)
        tts.decoder
    return tts, [w for w in caught if issubclass(w.category, CompiledArtifactsWarning)]


def cli_args(model, **kw) -> Namespace:
    return Namespace(**{**dict(model=str(model), codec=None, compute="cpu", dtype=None, context=CONTEXT,
                               compiled=None), **kw})


def test_servers_load_no_slot_and_speak_binds_the_exported_step_with_the_load(exported):
    served = load_tts(cli_args(exported), slot=False)  # `serve`, `ray-serve`: the batch engine has the decoder
    assert served.compiled is not None and served._decoder is None
    spoken = load_tts(cli_args(exported), warmup=False)  # `speak`
    assert spoken._decoder is not None and spoken._decoder.uses_exported_step


def assert_same_speech(tts: TTS, eager: TTS, voice: Voice | None = None, seeds=(1,)) -> None:
    for seed in seeds:
        with eager.stream(TEXT, seed=seed, max_frames=80, voice=voice) as wanted:
            want = np.concatenate(list(wanted))
        with tts.stream(TEXT, seed=seed, max_frames=80, voice=voice) as gotten:
            got = np.concatenate(list(gotten))
        assert len(gotten.frames) == len(wanted.frames) == 2
        for a, b in zip(gotten.frames, wanted.frames):
            assert torch.equal(a, b)
        assert got.shape == want.shape and got.size > 0
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def stale_copy(exported, tmp_path, edit=None, name="stale"):
    out = tmp_path / name
    shutil.copytree(exported / "compiled", out)
    if edit is not None:
        manifest = json.loads((out / MANIFEST).read_text())
        edit(manifest)
        (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def test_artifacts_found_in_the_model_dir_give_the_eager_codes_and_audio(exported, eager):
    manifest = json.loads((exported / "compiled" / MANIFEST).read_text())
    assert manifest["kernels"] == "higgs-rt"
    assert manifest["artifacts"]["codec.pt2"]["custom_ops"] == ["higgs_rt::rvq_lookup"]
    tts, warned = load(exported)
    assert not warned
    assert isinstance(tts.decoder.prefill_fn, PrefillRunner) and isinstance(tts.decoder.step_fn, StepRunner)
    assert isinstance(tts.codec.exported, CodecRunner) and tts.decoder.uses_exported_step
    assert_same_speech(tts, eager, seeds=(1, 4))
    codes = torch.randint(0, 16, (20, 8), generator=torch.Generator().manual_seed(0))
    assert_same_speech(tts, eager, Voice("Reference words here.", delay_pattern(codes, 16, 17)), seeds=(2, 3))


def test_exported_step_updates_the_decoder_state_as_the_eager_step(exported, eager):
    tts, _ = load(exported)
    decoders = [Decoder(t.talker, batch=1, context=CONTEXT, compiled=t.compiled) for t in (eager, tts)]
    prompt = eager.prompts.tts("State check.")
    for decoder in decoders:
        frames = decoder.start(0, prompt, SamplingParams(seed=7))[None]
        for _ in range(40):  # well past the EOS: finished slots must stay put
            frames = decoder.step_fn(frames)
    want, got = (step_state(d) for d in decoders)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


def test_the_probe_times_each_package_and_auto_follows_its_verdict(exported, eager, tmp_path, monkeypatch):
    artifacts = json.loads((exported / "compiled" / MANIFEST).read_text())["artifacts"]
    for file, key in [("step_b1.pt2", "probe_ms_per_step"), ("prefill.pt2", "probe_ms_per_call"),
                      ("codec.pt2", "probe_ms_per_call")]:
        timed = artifacts[file][key]
        assert set(timed) == {"exported", "eager"} and min(timed.values()) > 0, file
        assert artifacts[file]["faster_than_eager"] == (timed["exported"] < timed["eager"]), file

    def verdicts(m, faster):
        for entry in m["artifacts"].values():
            entry["faster_than_eager"] = faster

    for choice, faster, used in [("auto", False, False), ("auto", True, True), ("never", True, False),
                                 ("always", False, True)]:
        monkeypatch.setenv(CHOICE_ENV, choice)
        verdict = stale_copy(exported, tmp_path, lambda m: verdicts(m, faster), name=f"{choice}-{faster}")
        tts, warned = load(exported, compiled=verdict)
        assert not warned and tts.decoder.uses_exported_step == used, (choice, faster)
        assert isinstance(tts.decoder.prefill_fn, PrefillRunner) == used, (choice, faster)
        assert isinstance(tts.codec.exported, CodecRunner) == used, (choice, faster)
        if not used:
            assert not tts.decoder.uses_exported_step
        assert_same_speech(tts, eager)


def test_step_choice_follows_the_variable_and_the_verdict(monkeypatch):
    table = {(choice, verdict): use_exported({} if verdict is None else {"faster_than_eager": verdict}, choice)
             for choice in ("auto", "always", "never") for verdict in (True, False, None)}
    assert [k for k, used in table.items() if used] == [("auto", True), ("auto", None), ("always", True),
                                                         ("always", False), ("always", None)]
    monkeypatch.delenv(CHOICE_ENV)
    assert exported_choice() == "auto"
    monkeypatch.setenv(CHOICE_ENV, " Never ")
    assert exported_choice() == "never"
    monkeypatch.setenv(CHOICE_ENV, "fast")
    with pytest.raises(ValueError, match=r"^\$HIGGS_RT_EXPORTED must be one of auto, always, never, got 'fast'$"):
        exported_choice()


@pytest.mark.parametrize("edit", [
    lambda m: m.update(torch="2.0.0"),
    lambda m: m.update(talker="0123456789abcdef"),
    lambda m: m.update(context=CONTEXT * 2),
    lambda m: m.pop("artifacts"),
], ids=["torch-version", "checkpoint-hash", "context", "no-artifacts"])
def test_a_stale_manifest_warns_once_and_runs_eager(exported, eager, tmp_path, edit):
    tts, warned = load(exported, compiled=stale_copy(exported, tmp_path, edit))
    assert len(warned) == 1 and "running eager" in str(warned[0].message)
    assert tts.compiled is None and not tts.decoder.uses_exported_step
    assert_same_speech(tts, eager)


def test_a_corrupt_or_missing_artifact_warns_once_and_runs_eager(exported, eager, tmp_path):
    stale = stale_copy(exported, tmp_path)
    data = bytearray((stale / "step_b1.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (stale / "step_b1.pt2").write_bytes(bytes(data))
    (stale / "codec.pt2").unlink()
    tts, warned = load(exported, compiled=stale)
    assert len(warned) == 1 and "codec.pt2 is missing" in str(warned[0].message)
    assert not isinstance(tts.codec.exported, CodecRunner)
    assert_same_speech(tts, eager)

    (stale / MANIFEST).write_text("{ not json")
    _, warned = load(exported, compiled=stale)
    assert len(warned) == 1 and "unreadable" in str(warned[0].message)


def test_corrupt_step_alone_keeps_the_rest_and_warns_once(exported, tmp_path):
    stale = stale_copy(exported, tmp_path)
    data = bytearray((stale / "step_b1.pt2").read_bytes())
    data[100] ^= 0xFF
    (stale / "step_b1.pt2").write_bytes(bytes(data))
    tts, warned = load(exported, compiled=stale)
    assert len(warned) == 1 and "step_b1.pt2 is not the file that was exported" in str(warned[0].message)
    assert isinstance(tts.decoder.prefill_fn, PrefillRunner) and not tts.decoder.uses_exported_step


def test_a_batch_size_that_was_not_exported_steps_eagerly_with_one_warning(exported):
    tts, _ = load(exported)
    with pytest.warns(CompiledArtifactsWarning, match="no decode step for batch 2; exported: 1") as record:
        decoder = Decoder(tts.talker, batch=2, context=CONTEXT, compiled=tts.compiled)
    assert len(record) == 1
    assert not decoder.uses_exported_step and isinstance(decoder.prefill_fn, PrefillRunner)


def test_cli_speak_with_compiled_and_a_stale_dir(exported, tmp_path):
    args = ["speak", "Hi there.", "--model", str(exported), "--compute", "cpu", "--context", str(CONTEXT),
            "--seed", "3", "--max-frames", "80"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args + ["--out", str(tmp_path / "a.wav")]) == 0
    assert not [w for w in caught if issubclass(w.category, CompiledArtifactsWarning)]
    stale = stale_copy(exported, tmp_path, lambda m: m.update(higgs_rt="0.0.1"))
    with pytest.warns(CompiledArtifactsWarning, match="higgs_rt '0.0.1' exported"):
        assert main(args + ["--compiled", str(stale), "--out", str(tmp_path / "b.wav")]) == 0
    a, b = (sf.read(tmp_path / f"{name}.wav", dtype="int16")[0].astype(int) for name in "ab")
    assert a.shape == b.shape and a.size > 0 and np.abs(a - b).max() <= 1  # 16-bit rounding of equal audio


def test_export_usage_errors(capsys):
    assert main(["export", "--model", "/nonexistent/model", "--compute", "cpu"]) == 1
    assert main(["export", "--batch", "0", "--compute", "cpu"]) == 2
    assert main(["export", "--jobs", "0", "--compute", "cpu"]) == 2
    assert main(["export", "--batch", *map(str, range(1, 10)), "1", "--compute", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("higgs-rt: error:") == 4 and "--jobs must be >= 1, got 0" in err
    assert "--batch sizes must be >= 1, got [0]" in err and "--batch: at most 8 sizes (one step package each), got 9" in err


@pytest.fixture
def nothing_loads_or_compiles(monkeypatch):
    """Export's weights load and package compiles fail the test: a bad argument is to be refused before them."""
    import tools.export.build as build

    def never(*args, **kwargs):
        raise AssertionError("the weights loaded or a package compiled before the arguments were checked")

    monkeypatch.setattr(build, "_compile", never)
    monkeypatch.setattr(build.Talker, "from_pretrained", never)


@pytest.mark.parametrize("batch", ["100000", "past the address space", str(2**70)])
def test_export_batch_too_large_is_refused_before_anything_loads_or_compiles(random_model, tmp_path, capsys, batch,
                                                                             nothing_loads_or_compiles, monkeypatch):
    """--batch 100000 compiled the prefill (15 s on the tiny model) before the step's KV cache failed to allocate,
    with advice naming serve's --slots; 2**70 was torch's overflow error, C++ frames and all. Then on the CPU the
    check allocated the cache to see whether it fits: Linux granted --batch 100000's 26 GB and zero-filling it got
    the process OOM-killed. It is compared with the available memory (here 16 GB) and never allocated."""
    import higgs_rt.talker as talker
    from higgs_rt.config import TalkerConfig

    def never(*args, **kwargs):
        raise AssertionError("the KV cache was allocated to find out whether it fits")

    monkeypatch.setattr(talker.KVCache, "__init__", never)
    monkeypatch.setattr(talker, "available_memory", lambda device: 16 * 10**9)
    cfg = TalkerConfig.from_dir(random_model)
    if batch == "past the address space":  # 2^48 bytes and more
        batch = str((1 << 48) // (2 * cfg.num_layers * cfg.num_kv_heads * CONTEXT * cfg.head_dim * 4) + 1)
    needs = talker.KVCache.nbytes(cfg, int(batch), CONTEXT, torch.float32)
    size = f"{needs / 1e9:.2f} GB" if needs < 2**63 else "over 9223372037 GB"
    out = tmp_path / "artifacts"
    assert main(["export", "--model", str(random_model), "--out", str(out), "--compute", "cpu", "--context",
                 str(CONTEXT), "--batch", "1", batch]) == 1
    assert capsys.readouterr().err == (f"higgs-rt: error: --batch {batch}: the KV cache of {batch} slot(s) x {CONTEXT} "
                                       f"positions needs {size}, more than 90% of the 16.00 GB available on cpu: lower "
                                       "--batch or --context\n")
    assert not out.exists()


def test_export_empty_cxx_is_refused_before_anything_loads(random_model, tmp_path, capsys, nothing_loads_or_compiles):
    """`--cxx ''` was taken for no --cxx: a whole export with the default compiler."""
    out = tmp_path / "artifacts"
    assert main(["export", "--model", str(random_model), "--out", str(out), "--compute", "cpu", "--cxx", ""]) == 2
    assert capsys.readouterr().err == ("higgs-rt: error: --cxx is empty: name a C++ compiler, or leave --cxx out for "
                                       "$CXX, g++ or c++\n")
    assert not out.exists()


def test_export_out_that_is_a_file_is_refused_before_anything_loads(random_model, tmp_path, capsys,
                                                                     nothing_loads_or_compiles):
    out = tmp_path / "artifacts"
    out.write_text("mine")
    assert main(["export", "--model", str(random_model), "--out", str(out), "--compute", "cpu"]) == 2
    assert capsys.readouterr().err == f"higgs-rt: error: --out {out} exists and is not a directory\n"
    assert out.read_text() == "mine"


CRASH = "import ctypes; print('probe: loading prefill.pt2 and codec.pt2', flush=True); ctypes.string_at(0)"


def test_a_probe_that_crashes_or_fails_names_how_and_where(tmp_path):
    with pytest.raises(ExportProbeError, match="killed by SIGSEGV in a fresh process while loading prefill.pt2 and "
                                               "codec.pt2; no manifest written"):
        run_probe([sys.executable, "-c", CRASH], cwd=tmp_path)
    failing = "import sys; print('probe: running codec.pt2'); sys.exit('codec exploded')"
    with pytest.raises(ExportProbeError, match=r"failed \(codec exploded\) in a fresh process while running codec"):
        run_probe([sys.executable, "-c", failing], cwd=tmp_path)
    with pytest.raises(ExportProbeError, match="before loading anything"):  # exit 0 without its last stage
        run_probe([sys.executable, "-c", "pass"], cwd=tmp_path)


def test_export_whose_probe_crashes_writes_no_manifest_and_exits_1(random_model, tmp_path, monkeypatch, capsys):
    import tools.export.build as build

    def fake_compile(program, path, device, cxx, log):  # the packages' contents do not matter to the probe's wiring
        path.write_bytes(b"package")
        return {"sha256": "0" * 64, "bytes": 7, "compile_s": 0.0, "custom_ops": []}

    monkeypatch.setattr(build, "_compile", fake_compile)
    monkeypatch.setattr(build, "command", lambda *args: [sys.executable, "-c", CRASH])
    out = tmp_path / "artifacts"
    assert main(["export", "--model", str(random_model), "--out", str(out), "--compute", "cpu",
                 "--context", str(CONTEXT)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("higgs-rt: error: the exported packages were killed by SIGSEGV")
    assert err.count("higgs-rt: error") == 1 and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["codec.pt2", "prefill.pt2", "step_b1.pt2"]


def test_export_with_relative_paths_gives_the_probe_absolute_ones(random_model, tmp_path, monkeypatch, capsys):
    """`export --out rel` (or --model rel) from anywhere but the source checkout compiled every package, then
    failed: the probe runs in the checkout, where 'rel/manifest.json.tmp' does not exist."""
    import tools.export.build as build

    def fake_compile(program, path, device, cxx, log):
        path.write_bytes(b"package")
        return {"sha256": "0" * 64, "bytes": 7, "compile_s": 0.0, "custom_ops": []}

    def probe(cmd, cwd):
        paths = [Path(arg) for arg in cmd[3:7]]  # model, codec, out, staged manifest
        assert all(p.is_absolute() and p.exists() for p in paths), cmd
        raise ExportProbeError("probed")

    monkeypatch.setattr(build, "_compile", fake_compile)
    monkeypatch.setattr(build, "run_probe", probe)
    shutil.copytree(random_model, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--model", "model", "--out", "rel", "--compute", "cpu", "--context", str(CONTEXT)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "higgs-rt: error: probed"
    assert sorted(p.name for p in (tmp_path / "rel").iterdir()) == ["codec.pt2", "prefill.pt2", "step_b1.pt2"]


def test_export_out_that_cannot_be_made_is_one_line_naming_it(random_model, tmp_path, capsys):
    out = tmp_path / "file" / "artifacts"
    (tmp_path / "file").write_text("mine")
    assert main(["export", "--model", str(random_model), "--out", str(out), "--compute", "cpu", "--context",
                 str(CONTEXT)]) == 1
    assert capsys.readouterr().err == f"higgs-rt: error: --out {out}: cannot write there (Not a directory)\n"


LOADS_AND_ENDS = """
import os, sys
from pathlib import Path
from higgs_rt.compiled import StepRunner
from higgs_rt.engine import TTS
from higgs_rt.torch_compat import load_package

tts = TTS(sys.argv[1], device="cpu", context=int(sys.argv[2]))
assert tts.compiled is not None and isinstance(tts.decoder.step_fn, StepRunner), "the packages did not load"
try:
    load_package(Path(sys.argv[3]), -1)
except Exception as e:
    print("refused:", str(e).splitlines()[0])
sys.stdout.flush()
os._exit(0)  # no destructor runs: a process killed with its packages loaded ends so
"""


def broken_package(good: Path, out: Path) -> Path:
    """A copy of a package whose library is garbage: torch extracts it, then fails to load it."""
    import zipfile

    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, b"garbage" if info.filename.endswith(".so") else src.read(info))
    return out


def test_loaded_packages_leave_nothing_in_tmpdir_however_the_process_ends(exported, tmp_path):
    """torch's loader extracts a .pt2 into $TMPDIR/aotinductor_* and removes it only with the loader: a package
    that failed to load and a process ended without destructors left theirs (3.3 MB per CPU package). The runtime's
    packages are unpacked once under $HIGGS_RT_HOME/packages and loaded from there; a home that cannot be written
    loads them as before."""
    import os
    import subprocess

    from higgs_rt.home import default_home
    from higgs_rt.unpacked import LOCK, file_sha256

    compiled = exported / "compiled"
    broken = broken_package(compiled / "codec.pt2", tmp_path / "broken.pt2")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    run = [sys.executable, "-c", LOADS_AND_ENDS, str(exported), str(CONTEXT), str(broken)]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert r.returncode == 0 and "refused: " in r.stdout, r.stderr[-2000:]
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("aotinductor_")] == []
    for name in ("prefill.pt2", "step_b1.pt2", "codec.pt2", "broken.pt2"):
        path = (compiled if name != "broken.pt2" else tmp_path) / name
        assert (default_home() / "packages" / file_sha256(path)[:32] / LOCK).is_file(), name

    (tmp_path / "no-home").write_text("a file, not a directory")
    r = subprocess.run(run, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmpdir), "HIGGS_RT_HOME": str(tmp_path / "no-home")})
    assert r.returncode == 0 and "refused: " in r.stdout, r.stderr[-2000:]


def test_loadcheck_loads_and_runs_what_higgs_rt_packages_use():
    from tools.export.loadcheck import main as loadcheck

    assert loadcheck(["--device", "cpu", "--features", "custom-op+weights-apart"]) == {"custom-op+weights-apart": "ok"}


def test_torch_kernels_export_calls_no_python_and_gives_the_eager_speech(exported, eager, tmp_path):
    out = tmp_path / "torch-kernels"
    assert main(["export", "--model", str(exported), "--out", str(out), "--compute", "cpu", "--context", str(CONTEXT),
                 "--kernels", "torch", "--jobs", "2"]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["kernels"] == "torch" and not manifest["decode_kernels"]
    assert all(entry["custom_ops"] == [] for entry in manifest["artifacts"].values())
    tts, warned = load(exported, compiled=out)
    assert not warned and isinstance(tts.decoder.step_fn, StepRunner) and isinstance(tts.codec.exported, CodecRunner)
    assert_same_speech(tts, eager)


def test_a_failing_worker_names_its_package_and_why(tmp_path):
    from tools.export.build import _in_workers

    spec = {"model": str(tmp_path / "no-model"), "codec": str(tmp_path / "no-codec"), "out": str(tmp_path),
            "device": "cpu", "dtype": "float32", "context": 64, "kernels": "higgs-rt", "cxx": None}
    with pytest.raises(RuntimeError, match=r"export: the (prefill|step|codec) package.* failed in its worker process "
                                           r"\(exit 1\): .*no-(model|codec)"):
        _in_workers([("prefill", None), ("step", 1), ("codec", None)], 2, spec, print)


def test_packages_start_only_while_their_device_memory_fits_beside_the_running_ones():
    from tools.export.build import next_package

    needs = {("prefill", None): 10, ("step", 64): 50, ("step", 1): 12, ("codec", None): 9}
    waiting = list(needs)
    assert next_package(waiting, [], needs, 5) == ("prefill", None)  # the first starts whatever it needs
    assert next_package(waiting[1:], [("prefill", None)], needs, 60) == ("step", 64)  # 10 + 50 fit in 60
    assert next_package(waiting[1:], [("prefill", None)], needs, 59) == ("step", 1)  # the batch-64 step waits
    assert next_package(waiting[2:], [("prefill", None), ("step", 64)], needs, 60) is None
    assert next_package(waiting[2:], [("prefill", None), ("step", 64)], None, None) == ("step", 1)  # CPU: uncounted


def test_gpu_needs_count_the_weights_and_each_steps_kv_cache(tmp_path):
    from higgs_rt.codec import load_codec
    from higgs_rt.fixtures.codec import make_codec
    from higgs_rt.fixtures.talker import make_talker
    from higgs_rt.talker import KVCache, Talker
    from tools.export.build import _gpu_needs

    make_talker(tmp_path / "m", "tiny")
    make_codec(tmp_path / "c", "tiny")
    talker = Talker.from_pretrained(tmp_path / "m", dtype=torch.bfloat16, device="cpu", max_positions=64)
    codec = load_codec(tmp_path / "c", device="cpu")
    needs = _gpu_needs([("prefill", None), ("step", 1), ("step", 8), ("codec", None)], talker, codec, 64)
    weights = sum(t.numel() * t.element_size() for m in (talker, codec) for t in (*m.parameters(), *m.buffers()))
    assert needs[("prefill", None)] == needs[("codec", None)] == weights + 2**31
    cache = KVCache(talker.cfg, 8, 64, torch.bfloat16, "cpu")
    assert needs[("step", 8)] - needs[("prefill", None)] == cache.k.nbytes + cache.v.nbytes
    assert needs[("step", 8)] - needs[("step", 1)] == 7 * (cache.k.nbytes + cache.v.nbytes) // 8
