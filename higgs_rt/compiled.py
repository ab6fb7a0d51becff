"""Exported artifacts at run time: check them against what is loaded, then bind them in place of the eager calls.

`higgs-rt export` (tools/export) writes AOTInductor packages and a manifest into one directory:

    manifest.json    what they were built from and for (`target`), and each package's file, sha256 and shapes
    prefill.pt2      the Talker's prompt forward: any prompt length (2 to context) and number of audio frames
    step_b{B}.pt2    `Decoder.step` for B slots: Talker step, sampling and the delay-pattern state machine
    codec.pt2        `Code2Wav.decode` of one row: any number of frames from 2

No package holds weights. Each is compiled with `package_constants_in_so=False`; loading binds the runtime's
already-loaded tensors as its constants (`load_constants(..., user_managed=True)`: pointers, no copy). The
step's state goes in as inputs that it mutates in place, so the Decoder's tensors stay the only copy: exactly
the tensors the KV cache and the sampler declare in their `STATE` (`step_state`), recorded in the manifest with
shapes, dtypes and which ones a step writes (`state_spec`). The prefill returns its keys and values, which its
runner copies into the slot.

Packages are loaded from where `higgs_rt.unpacked` unpacks them, by the manifest's sha256 ($HIGGS_RT_HOME/packages),
not from torch's own $TMPDIR extraction (`torch_compat.load_package`).

Checked at load: format, higgs-rt and torch versions, device kind and architecture, dtypes, context, codebooks,
the checkpoints' identities (config.json and the safetensors headers: shapes, not weight values, which are
bound at run time) and every package's sha256. A mismatch, a missing or corrupt file or a package that does not
load gives one `CompiledArtifactsWarning` and the eager path; so does a decoder whose batch size or state was
not exported, or whose state is not 16-byte aligned (`misaligned_state`), for its step only. A package
(prefill, step or codec) that the export's probe timed slower than the eager path it replaces is not used (no
warning: the export said so), unless $HIGGS_RT_EXPORTED says otherwise (`use_exported`: "always" for benchmarks
and tests, whose outcome must not hang on a timing; "never"). Calls outside a package's shapes (a 1-position
prompt, a multi-row or 1-frame codec window) run eagerly, silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from . import __version__
from .torch_compat import Package, load_package
from .unpacked import file_sha256

if TYPE_CHECKING:
    from .codec import Code2Wav
    from .generate import Decoder
    from .talker import KVCache, Talker

FORMAT = 2  # 2: the state spec records which tensors a step writes
MANIFEST = "manifest.json"
SUBDIR = "compiled"  # MODEL/compiled/ is found without --compiled
PREFILL, CODEC = "prefill.pt2", "codec.pt2"
MIN_PROMPT, MIN_CODEC_FRAMES = 2, 2  # export specialises sizes 0 and 1 of these dims


class CompiledArtifactsWarning(UserWarning):
    """Exported artifacts were found or asked for but do not fit: the eager path runs instead."""


class StaleArtifacts(Exception):
    """Why a directory's artifacts cannot be used (the text of the one warning)."""


def step_file(batch: int) -> str:
    return f"step_b{batch}.pt2"


# ----------------------------------------------------------------------------- identities


def _update_with_file(digest, path: Path) -> None:
    """Size and header of a weights file: the safetensors header (names, dtypes, shapes, offsets); for other
    formats (Boson's model.pth, index files) the first and last MiB."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            digest.update(f.read(min(int.from_bytes(f.read(8), "little"), size - 8)))
        else:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())


def checkpoint_identity(directory: Path, files: list[Path]) -> str:
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in files:
        _update_with_file(digest, path)
    return digest.hexdigest()[:16]


def talker_identity(model_dir: str | Path) -> str:
    from .weights import checkpoint_files

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    return checkpoint_identity(model_dir, [index] * index.exists() + checkpoint_files(model_dir))


def codec_identity(codec_dir: str | Path) -> str:
    from .codec import CodecConfig
    from .codec.load import WEIGHTS_FILE

    codec_dir = Path(codec_dir)
    return checkpoint_identity(codec_dir, [codec_dir / WEIGHTS_FILE[CodecConfig.from_dir(codec_dir).layout]])


def device_arch(device: torch.device) -> str:
    """What compiled kernels are specific to: the GPU's compute capability, or the CPU's vector ISA."""
    if device.type == "cuda":
        return "sm_{}{}".format(*torch.cuda.get_device_capability(device))
    return torch.backends.cpu.get_cpu_capability()


def target(talker: "Talker", codec: "Code2Wav", model_dir, codec_dir, context: int) -> dict:
    """The manifest fields that must equal the running setup's for its artifacts to be used."""
    return {"format": FORMAT, "higgs_rt": __version__, "torch": torch.__version__, "device": talker.device.type,
            "arch": device_arch(talker.device), "dtype": str(talker.dtype).removeprefix("torch."),
            "codec_dtype": str(codec.table.dtype).removeprefix("torch."), "context": context,
            "num_codebooks": talker.cfg.num_codebooks, "talker": talker_identity(model_dir),
            "codec": codec_identity(codec_dir)}


STATE_OWNERS = ("cache", "sampler")  # the Decoder attributes whose classes declare decode-step state (`STATE`)


def step_state(decoder: "Decoder") -> dict[str, Tensor]:
    """A decoder's decode-step state by name (`cache.k`, `sampler.frame`, ...): the tensors its KV cache and sampler
    declare in their `STATE`, in that order. An exported step takes them as inputs after the frames."""
    return {f"{owner}.{name}": getattr(obj, name) for owner in STATE_OWNERS
            for obj in (getattr(decoder, owner),) for name in type(obj).STATE}


STATE_ALIGNMENT = 16  # bytes; AOTInductor compiles a GPU package's kernels for inputs aligned so


def misaligned_state(decoder: "Decoder") -> list[str]:
    """The decoder's state tensors whose data is not STATE_ALIGNMENT-byte aligned. A GPU package guards each input
    with a clone that runs when it is misaligned (`tools.export.buffers.alignment_guards`): a step would then write
    the clone and the decoder's own cache and sampler would never advance. Such a decoder steps eagerly; state
    allocated whole (KVCache, FrameSampler) is always aligned, so the guards never copy it."""
    return [name for name, t in step_state(decoder).items() if t.data_ptr() % STATE_ALIGNMENT]


def state_spec(decoder: "Decoder") -> list[list]:
    """[name, shape, dtype, written by the step] of each state tensor: the manifest records it for every step
    package, and a decoder whose spec differs runs its step eagerly (with the warning)."""
    written = {f"{owner}.{name}": w for owner in STATE_OWNERS
               for name, w in type(getattr(decoder, owner)).STATE.items()}
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch."), written[name]]
            for name, t in step_state(decoder).items()]


# ----------------------------------------------------------------------------- loading


def _load_package(path: Path, constants: dict[str, Tensor], device: torch.device, single_threaded: bool,
                  sha256: str | None = None) -> Package:
    index = -1 if device.type == "cpu" else device.index if device.index is not None else torch.cuda.current_device()
    package = load_package(path, index, single_threaded, sha256)
    needed = package.constant_names()
    missing = sorted(set(needed) - set(constants))
    if missing:
        raise StaleArtifacts(f"{path.name} needs constants the model lacks: {', '.join(missing[:4])}")
    package.bind_constants({n: constants[n] for n in needed})
    return package


def named_tensors(module: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
    """Parameters and buffers under the names the exported programs gave them (`talker.*`, `codec.*`)."""
    return {f"{prefix}.{n}": t for n, t in (*module.named_parameters(), *module.named_buffers())}


def _warn(directory: Path, reason: str) -> None:
    warnings.warn(f"higgs-rt: compiled artifacts in {directory} not used ({reason}); running eager. "
                  "Re-export them with `higgs-rt export`.", CompiledArtifactsWarning, stacklevel=3)


CHOICE_ENV = "HIGGS_RT_EXPORTED"
CHOICES = ("auto", "always", "never")


def exported_choice() -> str:
    """$HIGGS_RT_EXPORTED: "auto" (default: the export probe's verdict), "always" or "never"."""
    choice = os.environ.get(CHOICE_ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"${CHOICE_ENV} must be one of {', '.join(CHOICES)}, got {os.environ[CHOICE_ENV]!r}")
    return choice


def use_exported(entry: dict, choice: str) -> bool:
    """Whether the runtime takes the package whose manifest entry is `entry`: "always", "never", or "auto":
    unless the export's probe timed it slower than the eager path it replaces (an entry the probe did not time
    counts as faster: the probe itself runs it)."""
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice == "always" or (choice == "auto" and entry.get("faster_than_eager") is not False)


class Compiled:
    """A checked artifact directory bound to one Talker and codec (see the module docstring).

    Loading installs the codec runner (`codec.exported`, the hook `Code2Wav.decode` calls); decoders take `prefill` and `step_for(decoder)`. Each
    package is taken as `choice` says (`use_exported`: the probe's verdict, "always" or "never"); a benchmark may
    set `choice` on an instance to "always" to reach its steps whatever the verdict.
    """

    def __init__(self, directory: Path, manifest: dict, talker: "Talker", codec: "Code2Wav",
                 choice: str = "auto"):
        self.directory, self.manifest, self.talker = directory, manifest, talker
        self.choice = choice
        self._talker_constants = named_tensors(talker, "talker")
        self.prefill = talker.prefill
        if self.uses(PREFILL):
            self.prefill = PrefillRunner(talker, self._package(PREFILL, self._talker_constants), manifest["context"])
        if self.uses(CODEC):
            codec_model = self._package(CODEC, named_tensors(codec, "codec"))
            codec.exported = CodecRunner(codec, codec_model)  # `Code2Wav.decode`'s hook

    def uses(self, file: str) -> bool:
        """Whether the runtime takes this package (`use_exported` of its manifest entry and `choice`)."""
        return use_exported(self.manifest["artifacts"].get(file, {}), self.choice)

    def _package(self, file: str, constants: dict[str, Tensor], single_threaded: bool = False):
        entry = self.manifest["artifacts"].get(file)
        if entry is None:
            raise StaleArtifacts(f"the manifest lists no {file}")
        path = self.directory / file
        if not path.is_file():
            raise StaleArtifacts(f"{file} is missing")
        if file_sha256(path) != entry["sha256"]:
            raise StaleArtifacts(f"{file} is not the file that was exported (sha256 differs)")
        return _load_package(path, constants, self.talker.device, single_threaded, entry["sha256"])

    def warn(self, reason: str) -> None:
        _warn(self.directory, reason)

    def step_for(self, decoder: "Decoder") -> Callable[[Tensor], Tensor] | None:
        """The exported step bound to this decoder's state, or None (with the warning) when none fits it."""
        file = step_file(decoder.cache.batch)
        if not self.uses(file):
            return None  # the export's probe timed it slower than the eager step (and said so), or "never"
        try:
            if file not in self.manifest["artifacts"]:
                raise StaleArtifacts(f"no decode step for batch {decoder.cache.batch}; exported: "
                                     f"{', '.join(map(str, self.manifest['batch_sizes'])) or 'none'}")
            if self.manifest["artifacts"][file]["state"] != state_spec(decoder):
                raise StaleArtifacts(f"{file} was exported for another decoder state (names, shapes or dtypes)")
            misaligned = misaligned_state(decoder)
            if misaligned:
                raise StaleArtifacts(f"{file} needs its state {STATE_ALIGNMENT}-byte aligned; "
                                     f"{', '.join(misaligned)} is not")
            model = self._package(file, self._talker_constants, single_threaded=True)
        except Exception as e:
            self.warn(_reason(e))
            return None
        return StepRunner(model, list(step_state(decoder).values()))


class PrefillRunner:
    """`Talker.prefill` through the exported prompt forward: keys and values come back and go into the slot."""

    def __init__(self, talker: "Talker", model, max_prompt: int):
        self.talker, self.model, self.max_prompt = talker, model, max_prompt
        self.no_frames = torch.empty((0, talker.cfg.num_codebooks), dtype=torch.long, device=talker.device)

    def __call__(self, cache: "KVCache", slot: int, ids: Tensor, audio_frames: Tensor | None = None) -> Tensor:
        ids, audio_frames = self.talker.check_prompt(ids, audio_frames, cache.max_len)
        t = ids.shape[0]
        if not MIN_PROMPT <= t <= self.max_prompt:
            return self.talker.prefill(cache, slot, ids, audio_frames)
        frames = self.no_frames if audio_frames is None else audio_frames.contiguous()
        logits, k, v = self.model(ids.contiguous(), frames)
        cache.k[:, slot, :, :t] = k
        cache.v[:, slot, :, :t] = v
        cache.lengths[slot].fill_(t)
        return logits


class StepRunner:
    """`Decoder.step` through the exported step: frames [B, Q] in, next frames out, the state mutated in place."""

    exported = True  # what `Decoder` checks, without importing this module

    def __init__(self, model, state: list[Tensor]):
        self.model, self.state = model, state

    def __call__(self, frames: Tensor) -> Tensor:
        return self.model(frames, *self.state)[0]


class CodecRunner:
    """`Code2Wav.decode`'s hook: the exported decode for one row of >= 2 frames; None (eager) for anything else."""

    def __init__(self, codec: "Code2Wav", model):
        self.codec, self.model = codec, model

    def __call__(self, codes: Tensor) -> Tensor | None:
        if codes.dim() == 3 and codes.shape[0] == 1 and codes.shape[1] >= MIN_CODEC_FRAMES \
                and codes.shape[2] == self.codec.num_quantizers and codes.dtype == torch.int64:
            return self.model(codes.to(self.codec.table.device).contiguous())[0]
        return None


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, StaleArtifacts) else f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _mismatches(manifest: dict, running: dict) -> list[str]:
    return [f"{key} {manifest.get(key)!r} exported, {value!r} running" for key, value in running.items()
            if manifest.get(key) != value]


def load_compiled(directory: str | Path | bool | None, model_dir: Path, codec_dir: Path, talker: "Talker",
                  codec: "Code2Wav", context: int, manifest_file: str | Path | None = None,
                  choice: str | None = None) -> Compiled | None:
    """The artifacts in `directory` (None: MODEL/compiled/ if it exists; False: none), checked and bound, or None.

    A directory that was asked for (or found) but does not fit gives one `CompiledArtifactsWarning`.
    manifest_file: read this manifest instead of DIR/manifest.json (the exporter's probe of staged artifacts).
    choice: which packages to take (`use_exported`); default $HIGGS_RT_EXPORTED.
    """
    choice = choice or exported_choice()  # a bad value is the caller's error, not the artifacts'
    if directory is False:
        return None
    if directory is None:
        directory = Path(model_dir) / SUBDIR
        if not directory.is_dir():
            return None
    directory = Path(directory)
    try:
        try:
            manifest = json.loads(Path(manifest_file or directory / MANIFEST).read_text())
        except FileNotFoundError:
            raise StaleArtifacts(f"no {MANIFEST}") from None
        except (OSError, ValueError) as e:
            raise StaleArtifacts(f"{MANIFEST} is unreadable: {e}") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("artifacts"), dict):
            raise StaleArtifacts(f"{MANIFEST} is not a higgs-rt manifest")
        mismatches = _mismatches(manifest, target(talker, codec, model_dir, codec_dir, context))
        if mismatches:
            raise StaleArtifacts("; ".join(mismatches))
        return Compiled(directory, manifest, talker, codec, choice)
    except Exception as e:  # whatever is wrong with the artifacts, the eager path still speaks
        _warn(directory, _reason(e))
        return None
