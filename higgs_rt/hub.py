"""Where a Talker checkpoint comes from: a local directory, the Hugging Face cache, or a download.

Order: a directory given by path; else the repo id (default bosonai/higgs-audio-v2-generation-3B-base) in the
local Hugging Face cache; else a download of only what the runtime reads (config, safetensors, tokenizer),
skipped when HF_HUB_OFFLINE is set. Nothing found is one error naming every place looked at.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "bosonai/higgs-audio-v2-generation-3B-base"
TALKER_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]


class ModelNotFoundError(FileNotFoundError):
    """No Talker checkpoint where higgs-rt looked; the message lists every place."""


def offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub reads it."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return flag or bool(constants.HF_HUB_OFFLINE)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") != 1 or os.sep in name.replace("/", "", 1)


def resolve_model_dir(model: str | Path | None = None, progress: bool = False) -> Path:
    """The directory holding the Talker's config.json, safetensors and tokenizer.json."""
    name = str(model) if model is not None else DEFAULT_MODEL
    local = Path(name).expanduser()
    if local.is_dir():
        missing = [f for f in ("config.json", "tokenizer.json") if not (local / f).is_file()]
        if missing:
            raise ModelNotFoundError(f"{local} is not a Higgs-Audio v2 model directory: no {' or '.join(missing)}")
        return local
    if _looks_like_path(name):
        raise ModelNotFoundError(f"no model directory at {local}")

    import huggingface_hub
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    looked = []
    try:
        return Path(huggingface_hub.snapshot_download(name, allow_patterns=TALKER_FILES, local_files_only=True))
    except Exception:
        looked.append(f"Hugging Face cache {huggingface_hub.constants.HF_HUB_CACHE}: {name} not cached")
    if offline():
        looked.append(f"download of {name}: skipped, HF_HUB_OFFLINE is set")
    else:
        (enable_progress_bars if progress else disable_progress_bars)()
        try:
            return Path(huggingface_hub.snapshot_download(name, allow_patterns=TALKER_FILES))
        except Exception as e:  # network, auth, unknown repo: all end in the one error below
            looked.append(f"download of {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise ModelNotFoundError(f"model {name} not found: " + "; ".join(looked) +
                             ". Give --model a local directory (higgs-rt make-random-checkpoint DIR makes a random one).")
