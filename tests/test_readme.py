"""The README's shell and Python blocks, run as written, as a reader would run them, with tiny random models.

The sandbox: a fresh $HIGGS_RT_HOME; `/tmp/...` paths moved into a temporary directory (several checkouts may
run the suite at once); an offline Hugging Face cache in which bosonai/higgs-audio-v2-generation-3B-base (the
default model) and bosonai/higgs-audio-v2-tokenizer (the default codec) are tiny random checkpoints, so the lines
that would download the real weights run too; the voice-cloning examples' alice.wav and bob.flac rendered by
espeak-ng and sox; playback into a PulseAudio null sink. Shell blocks run one by one, in the README's order
(later ones use what earlier ones wrote), each as one `bash -e` script; the Python blocks run as one script, as
one reader's session. Skipped, each with its reason (`SKIPPED_LINES`, `SKIPPED_SECTIONS`): installs, the test
suite itself, and the Server section, whose commands and WebSocket client the server tests run. Untagged blocks
are synopses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIPPED_LINES = {
    r"^(python3 -m venv|pip install) ": "an install: this suite runs inside it (.ci/run installs as written, "
                                       "on a clean clone)",
    r"^sudo apt-get install ": "system packages: .ci/run installs them; tests that need them skip without them",
    r"^python -m pytest\b": "the test suite itself",
    r"^(cmake -S examples|build/examples/)": "the C++ host, built from the checkout: tests/test_export_host.py "
                                            "builds it once per session and checks its codes",
}
SKIPPED_SECTIONS = {
    "Server": "starts a server: tests/test_server_process.py runs serve (bind, requests, shutdown), "
              "tests/test_server.py the curl request's JSON and tests/test_server_ws.py the WebSocket client",
    "Scaling out": "needs a container engine and a Kubernetes cluster, or starts Ray: "
                   "tests/test_deploy_kubernetes.py validates the manifests, tests/test_deploy_ray.py runs "
                   "ray-serve's application",
}
DEFAULT_MODEL = "bosonai/higgs-audio-v2-generation-3B-base"
DEFAULT_CODEC = "bosonai/higgs-audio-v2-tokenizer"


@dataclass
class Block:
    section: str
    language: str
    lines: list[str]  # continuation lines joined

    @property
    def id(self) -> str:
        return f"{self.section}:{self.lines[0][:40] if self.lines else ''}"


def readme_blocks() -> list[Block]:
    blocks, section, inside = [], "Quick start", None
    for line in README.read_text().splitlines():
        if inside is None and line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```"):
            if inside is None:
                inside = Block(section, line[3:].strip(), [])
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            if inside.lines and inside.lines[-1].endswith("\\"):
                inside.lines[-1] = inside.lines[-1][:-1] + " " + line.strip()
            else:
                inside.lines.append(line)
    assert inside is None, "an unclosed code block in README.md"
    return blocks


def skip_reason(block: Block, line: str) -> str | None:
    if block.section in SKIPPED_SECTIONS:
        return SKIPPED_SECTIONS[block.section]
    return next((why for pattern, why in SKIPPED_LINES.items() if re.search(pattern, line.strip())), None)


SHELL = [b for b in readme_blocks() if b.language == "bash"]
PYTHON = [b for b in readme_blocks() if b.language == "python" and b.section not in SKIPPED_SECTIONS]


def test_the_readme_has_the_blocks_this_test_runs():
    """Every block is a shell or Python one (run) or an untagged synopsis; what is skipped is listed with why."""
    blocks = readme_blocks()
    assert {b.language for b in blocks} <= {"bash", "python", ""}
    runnable = [line for b in SHELL for line in b.lines if line.strip() and not line.lstrip().startswith("#")
                and skip_reason(b, line) is None]
    skipped = {line.strip(): skip_reason(b, line) for b in SHELL for line in b.lines if skip_reason(b, line)}
    assert len(runnable) >= 10 and len(PYTHON) >= 2
    assert any("make-random-checkpoint /tmp/tiny" in line for line in runnable)
    assert all(why for why in skipped.values())
    print("\n".join(f"skipped: {line}  ({why})" for line, why in skipped.items()))


# ---------------------------------------------------------------- the sandbox


def _cached_repo(hub: Path, repo: str, files: Path) -> None:
    """`files` as the cached snapshot of `repo`, as huggingface_hub lays a download out."""
    root = hub / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files, root / "snapshots" / ("0" * 40), dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text("0" * 40)


@pytest.fixture(scope="module")
def sandbox(random_model, tmp_path_factory):
    """The directory the README's commands run in (work/), and their environment."""
    from higgs_rt.fixtures.codec import make_codec

    root = tmp_path_factory.mktemp("readme")
    hub = root / "hf" / "hub"
    _cached_repo(hub, DEFAULT_MODEL, random_model)  # with its codec in audio_tokenizer/
    make_codec(root / "boson-codec", "tiny", layout="boson", seed=9)  # config.json + model.pth, as the repo has
    _cached_repo(hub, DEFAULT_CODEC, root / "boson-codec")
    (root / "work").mkdir()
    (root / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIGGS_AUDIO_", "HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1", HIGGS_RT_HOME=str(root / "home"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return root, env


def sandboxed(text: str, root: Path) -> str:
    return re.sub(r"(?<![\w.])/tmp/", f"{root}/tmp/", text)


def _needs(request, text: str, env: dict) -> None:
    """Fixtures the text needs: a playback device (PulseAudio null sink), the voice-cloning recordings."""
    plays = re.search(r"higgs-rt speak (?!.*--out)(?!.*--list-devices)|\.speak\(", text)
    if plays:
        request.getfixturevalue("pulse_device")  # skips (or fails on CI) without it
        env.update({k: os.environ[k] for k in ("PULSE_SERVER", "PULSE_COOKIE", "PULSE_RUNTIME_PATH")})
    work = Path(env["HIGGS_RT_README_WORK"])
    if "alice.wav" in text or "bob.flac" in text:
        speech = request.getfixturevalue("speech")
        shutil.copy(speech["22k"], work / "alice.wav")
        shutil.copy(speech["flac"], work / "bob.flac")


def _run(cmd: list[str], work: Path, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_runs_as_written(block, sandbox, request):
    root, base_env = sandbox
    lines, skipped = [], []
    for line in block.lines:
        why = skip_reason(block, line)
        (skipped.append(f"{line.strip()} ({why})") if why else lines.append(line))
    if not any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        pytest.skip("; ".join(skipped))
    script = sandboxed("\n".join(lines), root)
    env = dict(base_env, HIGGS_RT_README_WORK=str(root / "work"))
    _needs(request, script, env)
    _run(["bash", "-e", "-o", "pipefail", "-c", script], root / "work", env)
    if "--out hello.wav" in script:  # the quick start's promise
        import soundfile as sf

        info = sf.info(root / "work" / "hello.wav")
        assert (info.samplerate, info.channels) == (24000, 1) and info.frames > 0


def test_python_blocks_run_as_written(sandbox, request):
    root, base_env = sandbox
    script = sandboxed("\n\n".join("\n".join(b.lines) for b in PYTHON), root)
    env = dict(base_env, HIGGS_RT_README_WORK=str(root / "work"))
    _needs(request, script, env)
    r = _run([sys.executable, "-c", script], root / "work", env)
    assert "RTF" in r.stdout  # the API block prints the stats' summary
