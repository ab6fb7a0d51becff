"""Find a codec checkpoint and load its decode weights into `Code2Wav`, from either layout, strictly.

Where the codec comes from, first hit wins (local places before the network):
1. the `path` argument (`--codec`);
2. the codec bundled with the model: `model_dir/audio_tokenizer/` when it holds a config.json;
3. $HIGGS_AUDIO_TOKENIZER_PATH, then $HIGGS_AUDIO_V2_TOKENIZER_PATH;
4. the local Hugging Face cache of bosonai/higgs-audio-v2-tokenizer;
5. downloading config.json and model.pth of that repo, skipped at once when HF_HUB_OFFLINE is set or the Hub
   does not answer (`higgs_rt.hub.download_blocker`).
A location given explicitly (1 to 3) must hold a codec: it is an error, not a fall-through, when it does not.
A directory may also hold the codec in an `audio_tokenizer/` subdirectory (OmniVoice's packaging).

Layouts: transformers (config.json + model.safetensors, plain weights) and Boson (config.json + model.pth, DAC
weight norm). Boson's repo also has a model.safetensors, which is a copy of the Talker: it is never read.
`load_codec` reads only the decode path (quantizer embed/project_out, fc2, acoustic decoder); weight norm is
folded, and each codebook's embed -> project_out (+ bias) becomes one row block of a [Q, K, hidden] table.
`load_encoder` reads the encode path (acoustic encoder, HuBERT, semantic encoder, fc, quantizers) only when
voice cloning asks for it. Every tensor read must be stored in a floating-point type and hold no NaN or inf
(checked once per load, `higgs_rt.weights.FiniteCheck`).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError
from ..weights import FiniteCheck, check_floating
from .config import CodecConfig, EncodeConfig
from .encode import Wav2Code
from .model import Code2Wav

REPO_ID = "bosonai/higgs-audio-v2-tokenizer"
ENV_VARS = ("HIGGS_AUDIO_TOKENIZER_PATH", "HIGGS_AUDIO_V2_TOKENIZER_PATH")
WEIGHTS_FILE = {"transformers": "model.safetensors", "boson": "model.pth"}
SUBDIR = "audio_tokenizer"


class CodecNotFoundError(FileNotFoundError):
    """No codec checkpoint where higgs-rt looked; the message lists every place."""


class CodecCheckpointError(ValueError):
    """A codec checkpoint that lacks a decode tensor or has one of the wrong shape."""


# ----------------------------------------------------------------------------- finding the checkpoint


def _problem(directory: Path) -> str | None:
    """Why `directory` does not hold a codec checkpoint, or None when it does."""
    if not directory.is_dir():
        return "not a directory"
    if not (directory / "config.json").is_file():
        return "no config.json"
    layout = CodecConfig.from_dir(directory).layout
    if not (directory / WEIGHTS_FILE[layout]).is_file():
        return f"{layout} config.json but no {WEIGHTS_FILE[layout]}"
    return None


def _explicit(value: str | Path, source: str) -> Path:
    directory = Path(value).expanduser()
    nested = directory / SUBDIR
    if (nested / "config.json").is_file() and _problem(nested) is None:
        return nested
    problem = _problem(directory)
    if problem:
        raise CodecNotFoundError(f"no Higgs-Audio v2 codec at {source}={directory}: {problem}")
    return directory


def resolve_codec_dir(path: str | Path | None = None, model_dir: str | Path | None = None) -> Path:
    """The directory holding the codec's config.json and weights (see the module docstring for the order);
    `model_dir`: the model whose bundled `audio_tokenizer/` comes second."""
    if path is not None:
        return _explicit(path, "path")
    looked = ["path argument: not given"]
    if model_dir is not None:
        bundled = Path(model_dir) / SUBDIR
        if (bundled / "config.json").is_file():
            return _explicit(bundled, "the model's codec")
        looked.append(f"the model's codec {bundled}: none")
    for var in ENV_VARS:
        if os.environ.get(var):
            return _explicit(os.environ[var], f"${var}")
    looked += [f"${var}: not set" for var in ENV_VARS]

    import huggingface_hub
    from huggingface_hub import constants

    from ..hub import download_blocker

    cache = constants.HF_HUB_CACHE
    cached = [huggingface_hub.try_to_load_from_cache(REPO_ID, f, cache_dir=cache) for f in ("config.json", "model.pth")]
    if all(isinstance(c, str) for c in cached) and Path(cached[0]).parent == Path(cached[1]).parent:
        return Path(cached[0]).parent
    looked.append(f"Hugging Face cache {cache}: {REPO_ID} config.json + model.pth not cached")

    blocker = download_blocker()
    if blocker:
        looked.append(f"download of {REPO_ID}: {blocker}")
    else:
        try:
            files = [huggingface_hub.hf_hub_download(REPO_ID, f) for f in ("config.json", "model.pth")]
            return Path(files[0]).parent
        except Exception as e:  # auth, disk, a network that failed after the probe: all end in the one error below
            looked.append(f"download of {REPO_ID}: {type(e).__name__}: {e}")
    raise CodecNotFoundError(
        "no Higgs-Audio v2 codec found. Looked at:\n  - " + "\n  - ".join(looked) + "\nGive --codec (or set "
        f"${ENV_VARS[0]}) a directory with config.json + model.safetensors (transformers layout) or "
        "config.json + model.pth (Boson layout)."
    )


# ----------------------------------------------------------------------------- reading the weights


_BOSON_INNER = ("snake1", "conv1", "snake2", "conv2")


def boson_key(name: str, n_blocks: int) -> str:
    """A codec key in transformers' naming -> Boson's name for the same tensor (unchanged where they agree,
    e.g. HuBERT's `semantic_model.*`); transformers' weight-norm parametrization becomes weight_g / weight_v."""
    enc = r"^acoustic_encoder\."
    rules = (
        # decode path
        (r"^acoustic_decoder\.conv1\.", lambda m: "decoder_2.model.0."),
        (r"^acoustic_decoder\.block\.(\d+)\.snake1\.", lambda m: f"decoder_2.model.{int(m[1]) + 1}.block.0."),
        (r"^acoustic_decoder\.block\.(\d+)\.conv_t1\.", lambda m: f"decoder_2.model.{int(m[1]) + 1}.block.1."),
        (r"^acoustic_decoder\.block\.(\d+)\.res_unit(\d)\.(snake1|conv1|snake2|conv2)\.",
         lambda m: f"decoder_2.model.{int(m[1]) + 1}.block.{int(m[2]) + 1}.block.{_BOSON_INNER.index(m[3])}."),
        (r"^acoustic_decoder\.snake1\.", lambda m: f"decoder_2.model.{n_blocks + 1}."),
        (r"^acoustic_decoder\.conv2\.", lambda m: f"decoder_2.model.{n_blocks + 2}."),
        (r"^quantizer\.quantizers\.(\d+)\.(codebook\.)?",
         lambda m: f"quantizer.vq.layers.{m[1]}.{'_codebook.' if m[2] else ''}"),
        (r"^fc2\.", lambda m: "fc_post2."),
        # encode path
        (enc + r"conv1\.", lambda m: "encoder.block.0."),
        (enc + r"block\.(\d+)\.res_unit(\d)\.(\w+)\.",
         lambda m: f"encoder.block.{int(m[1]) + 1}.block.{int(m[2]) - 1}.block.{_BOSON_INNER.index(m[3])}."),
        (enc + r"block\.(\d+)\.snake1\.", lambda m: f"encoder.block.{int(m[1]) + 1}.block.3."),
        (enc + r"block\.(\d+)\.conv1\.", lambda m: f"encoder.block.{int(m[1]) + 1}.block.4."),
        (enc + r"snake1\.", lambda m: f"encoder.block.{n_blocks + 1}."),
        (enc + r"conv2\.", lambda m: f"encoder.block.{n_blocks + 2}."),
        (r"^fc\.", lambda m: "fc_prior."),
        (r"^fc1\.", lambda m: "fc_post1."),
        # Boson wraps every semantic conv but the residual units' 1x1 conv2 in a module holding `.conv`.
        (r"^((?:en|de)coder_semantic\.(?:.*\.)?)(conv|conv1|conv2)\.(weight|bias)$",
         lambda m: m[0] if re.search(r"res_units\.\d+\.conv2\.", m[0]) else f"{m[1]}{m[2]}.conv.{m[3]}"),
    )
    for pattern, replace in rules:  # at most one applies
        name, hits = re.subn(pattern, replace, name, count=1)
        if hits:
            break
    return re.sub(r"\.parametrizations\.weight\.original([01])$", lambda m: (".weight_g", ".weight_v")[int(m[1])], name)


def _open_tensors(directory: Path, layout: str) -> tuple[Callable[[str], torch.Tensor | None], set[str]]:
    """(tensor by stored name or None, the stored names)."""
    file = directory / WEIGHTS_FILE[layout]
    try:
        if layout == "transformers":
            from safetensors import safe_open

            handle = safe_open(file, framework="pt")  # closed when the reader is dropped
            names = set(handle.keys())
            # Only the names asked for are materialised (the file also holds the encoder and HuBERT).
            return (lambda key: handle.get_tensor(key) if key in names else None), names
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or corrupted file: say which one
        raise CodecCheckpointError(f"{file}: cannot read codec weights: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise CodecCheckpointError(f"{file}: expected a state dict, got {type(state).__name__}")
    return state.get, set(state)


def _fold_weight_norm(g: torch.Tensor, v: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """w = g * v / ||v||, the norm over every dim but `dim` (computed in fp64, returned in v's dtype)."""
    v64 = v.double()
    others = [d for d in range(v.dim()) if d != dim]
    norm = v64.norm(dim=others, keepdim=True)
    return (g.double().reshape(norm.shape) * v64 / norm).to(v.dtype)


def _reader(directory: Path, config: CodecConfig) -> Callable[..., torch.Tensor]:
    """get(transformers_name, shape, norm_dim=0) -> tensor as stored, from either layout; weight norm (over
    every dim but norm_dim) folded; strict. Floating-point only; `get.check_finite()` once all are read."""
    file = directory / WEIGHTS_FILE[config.layout]
    stored, names = _open_tensors(directory, config.layout)
    n_blocks = len(config.upsampling_ratios)
    finite = FiniteCheck(CodecCheckpointError)

    def raw(key: str) -> torch.Tensor | None:
        tensor = stored(key)
        if tensor is not None:
            check_floating(f"{file}: {key!r}", tensor, CodecCheckpointError)
        return tensor

    def get(name: str, shape: tuple[int, ...], norm_dim: int = 0) -> torch.Tensor:
        key = name if config.layout == "transformers" else boson_key(name, n_blocks)
        tensor, source = raw(key), repr(key)
        if tensor is None and key.endswith(".weight"):
            base = key[: -len("weight")]
            parametrized = base + "parametrizations.weight.original"
            for g_key, v_key in ((base + "weight_g", base + "weight_v"), (parametrized + "0", parametrized + "1")):
                g, v = raw(g_key), raw(v_key)
                if g is not None and v is not None:
                    if tuple(v.shape) != shape or g.numel() != shape[norm_dim]:
                        raise CodecCheckpointError(
                            f"{file}: {v_key!r} / {g_key!r} have shapes {tuple(v.shape)} / {tuple(g.shape)}, "
                            f"expected {shape} / {shape[norm_dim]} magnitudes for this config.json"
                        )
                    tensor, source = _fold_weight_norm(g, v, norm_dim), f"{v_key!r} / {g_key!r}"
                    break
        if tensor is None:
            also = " (nor its weight_g/weight_v)" if key.endswith(".weight") else ""
            raise CodecCheckpointError(f"{file}: decode tensor {key!r} is missing{also}")
        if tuple(tensor.shape) != shape:
            raise CodecCheckpointError(
                f"{file}: {key!r} has shape {tuple(tensor.shape)}, expected {shape} for this config.json"
            )
        finite.add(f"{file}: {source}", tensor)
        return tensor

    get.names = names  # the stored names, for counts compared before a model is built
    get.check_finite = finite.check
    return get


def _folded_table(get, config: CodecConfig) -> torch.Tensor:
    """table[q, c] = project_out_q(embed_q[c]), bias included, computed in fp32 like the reference's per-code path."""
    k, d, h = config.codebook_size, config.codebook_dim, config.hidden_dim
    rows = []
    for q in range(config.num_quantizers):
        prefix = f"quantizer.quantizers.{q}."
        embed = get(prefix + "codebook.embed", (k, d)).float()
        weight, bias = get(prefix + "project_out.weight", (h, d)), get(prefix + "project_out.bias", (h,))
        rows.append(torch.nn.functional.linear(embed, weight.float(), bias.float()))
    return torch.stack(rows)


def _on_meta(build: Callable[[], torch.nn.Module], directory: Path) -> torch.nn.Module:
    """The module config.json describes, built without memory; sizes no tensor can have (each field in range, their
    product past what torch can index) are a ConfigError, not torch's overflow."""
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, ValueError, OverflowError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{directory / 'config.json'}: codec config: its sizes make no model torch can build "
                          f"({why[:120]})") from None


def load_codec(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Code2Wav:
    """Resolve, read and fold the codec's decode weights; returns an eval-mode `Code2Wav` on device/dtype."""
    directory = resolve_codec_dir(path)
    config = CodecConfig.from_dir(directory)
    get = _reader(directory, config)
    model = _on_meta(lambda: Code2Wav(config), directory)
    state = {"table": _folded_table(get, config)}
    for name, like in model.state_dict().items():
        if name not in state:
            state[name] = get(name, tuple(like.shape))
    get.check_finite()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device=device).eval()


_POS_CONV = "semantic_model.encoder.pos_conv_embed.conv.weight"  # HuBERT's weight norm keeps the kernel dim (2)
# Repeated parts of the encode path (named alike in both layouts): (stored name, config field, what they are)
_ENCODER_DEPTHS = (
    (re.compile(r"^semantic_model\.encoder\.layers\.(\d+)\."), "semantic_model_config.num_hidden_layers",
     "HuBERT layers"),
    (re.compile(r"^semantic_model\.feature_extractor\.conv_layers\.(\d+)\."), "semantic_model_config.conv_dim",
     "HuBERT conv layers"),
    (re.compile(r"^encoder_semantic\.conv_blocks\.(\d+)\."), "strides", "semantic encoder blocks"),
    (re.compile(r"^encoder_semantic\.conv_blocks\.0\.res_units\.(\d+)\."), "block_dilations",
     "residual units a semantic block"),
)


def _check_encoder_depth(names: set[str], config: EncodeConfig, file: Path) -> None:
    """A layer count far past the checkpoint's took minutes (2**31-1 layers: for ever) to build before the first
    missing tensor was named: the counts are compared first."""
    wants = {"semantic_model_config.num_hidden_layers": config.hubert.num_layers,
             "semantic_model_config.conv_dim": len(config.hubert.conv_dim), "strides": len(config.strides),
             "block_dilations": len(config.block_dilations)}
    for pattern, field, what in _ENCODER_DEPTHS:
        have = len({m[1] for name in names if (m := pattern.match(name))})
        if have != wants[field]:
            raise CodecCheckpointError(f"{file}: holds {have} {what}, the config's {field} gives {wants[field]}")


def load_encoder(path: str | Path | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Wav2Code:
    """Resolve and read the codec's encode weights (only voice cloning needs them); an eval-mode `Wav2Code`."""
    directory = resolve_codec_dir(path)
    config = EncodeConfig.from_dir(directory)
    get = _reader(directory, config.codec)
    _check_encoder_depth(get.names, config, directory / WEIGHTS_FILE[config.codec.layout])
    model = _on_meta(lambda: Wav2Code(config), directory)
    state = {name: get(name, tuple(like.shape), 2 if name == _POS_CONV else 0)
             for name, like in model.state_dict().items()}
    get.check_finite()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device=device).eval()


def codec_id(path: str | Path | None = None) -> str:
    """A short fingerprint of a codec checkpoint: config.json, then the weights file's size and its first and
    last MiB (a zip's central directory holds every entry's CRC). Codes from one codec are not another's."""
    directory = resolve_codec_dir(path)
    weights = directory / WEIGHTS_FILE[CodecConfig.from_dir(directory).layout]
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    size = weights.stat().st_size
    digest.update(str(size).encode())
    with open(weights, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:16]
