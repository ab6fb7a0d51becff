"""The package's surface: `import higgs_rt` is cheap and lazy, the public names resolve, `--version` and `--help`
load no torch. Each check runs in a fresh interpreter, since this test process has imported everything."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import higgs_rt

HEAVY = ("torch", "transformers", "sounddevice", "soundfile", "soxr", "starlette", "uvicorn", "higgs_rt.server",
         "higgs_rt.engine", "numpy", "ray", "wyoming")
# What speaking never needs: the reference implementation, audio devices and files, the servers, Ray, Wyoming.
OPTIONAL = ("transformers", "sounddevice", "soundfile", "soxr", "starlette", "uvicorn", "fastapi", "ray", "wyoming",
            "higgs_rt.server", "higgs_rt.server_process", "higgs_rt.speech_ws", "higgs_rt.wyoming_server",
            "higgs_rt.deploy", "torch._dynamo", "torch._inductor")


def fresh(code: str) -> dict:
    """Run `code` in a new interpreter; it sets `result`, which comes back as JSON."""
    run = subprocess.run([sys.executable, "-c", code + "\nimport json; print(json.dumps(result))"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_loads_nothing_heavy():
    loaded = fresh(f"import sys, higgs_rt\nresult = [m for m in {HEAVY!r} if m in sys.modules]")
    assert loaded == []


def test_public_names_resolve_to_their_modules():
    from higgs_rt.engine import TTS
    from higgs_rt.types import StreamStats, Voice
    from higgs_rt.params import SamplingParams, SynthesisParams

    assert (higgs_rt.TTS, higgs_rt.Voice, higgs_rt.StreamStats) == (TTS, Voice, StreamStats)
    assert (higgs_rt.SynthesisParams, higgs_rt.SamplingParams) == (SynthesisParams, SamplingParams)
    for name in higgs_rt.__all__:
        assert getattr(higgs_rt, name) is not None
    assert set(higgs_rt.__all__) <= set(dir(higgs_rt))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        higgs_rt.nothing_here  # noqa: B018


def test_from_higgs_rt_import_tts_as_the_readme_does():
    result = fresh("import sys\nfrom higgs_rt import TTS, SynthesisParams\n"
                   "result = [TTS.__module__, SynthesisParams.create(seed=3).seed, 'torch' in sys.modules]")
    assert result == ["higgs_rt.engine", 3, True]
    # the parameter table alone stays light
    result = fresh("import sys\nfrom higgs_rt import SynthesisParams\nresult = 'torch' in sys.modules")
    assert result is False


def test_version():
    from importlib.metadata import version

    assert higgs_rt.__version__ == version("higgs-rt")
    run = subprocess.run([sys.executable, "-m", "higgs_rt.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == f"higgs-rt {higgs_rt.__version__}"


@pytest.mark.parametrize("command", [[], ["speak"], ["voice"], ["voice", "add"], ["serve"], ["client"], ["export"],
                                     ["make-random-checkpoint"]])
def test_help_imports_no_torch(command):
    code = (f"import sys\nfrom higgs_rt.cli import main\ntry:\n    main({command + ['--help']!r})\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"result = [code, [m for m in {HEAVY!r} if m in sys.modules]]")
    assert fresh(code) == [0, []]


@pytest.mark.parametrize("module", ["higgs_rt.engine", "higgs_rt.cli", "higgs_rt.model", "higgs_rt.timing"])
def test_cold_start_stays_lazy(module):
    """Importing the engine (torch, the model code) or the CLI loads none of the optional parts."""
    loaded = fresh(f"import sys, {module}\nresult = [m for m in {OPTIONAL!r} if m in sys.modules]")
    assert loaded == []


def test_speak_to_a_wav_loads_nothing_optional(random_model, tmp_path):
    """A whole `speak --out x.wav` (load, synthesis, file) in a fresh process: none of the optional parts, and no
    torch.compile machinery (torch._dynamo costs seconds of cold start)."""
    argv = ["speak", "Hello there.", "--model", str(random_model), "--out", str(tmp_path / "x.wav")]
    result = fresh(f"import sys\nfrom higgs_rt.cli import main\ncode = main({argv!r})\n"
                   f"result = [code, [m for m in {OPTIONAL!r} if m in sys.modules]]")
    assert result == [0, []]
