"""Where a Talker checkpoint comes from: a local directory, the Hugging Face cache, or a download.

Order: a directory given by path; else the repo id (default bosonai/higgs-audio-v2-generation-3B-base) in the
local Hugging Face cache; else a download of only what the runtime reads (config, safetensors, tokenizer),
skipped when HF_HUB_OFFLINE is set or the Hub does not answer one quick request (`hub_unreachable`: so a
machine without network fails at once instead of after huggingface_hub's retries). Nothing found is one error
naming every place looked at. The codec's resolution (`higgs_rt.codec.load`) uses the same two checks.
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


HUB_PROBE_TIMEOUT_S = 5.0  # one request; a reachable Hub answers in well under a second


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face Hub cannot be reached now (one HEAD request through huggingface_hub's own session,
    its endpoint and proxies, without retries), or None when it answers at all."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:  # DNS, refused, timeout, TLS: the download would only retry the same
        return f"{constants.ENDPOINT} is unreachable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def download_blocker() -> str | None:
    """Why a download must not be tried (offline, or the Hub unreachable), or None."""
    if offline():
        return "skipped, HF_HUB_OFFLINE is set"
    unreachable = hub_unreachable()
    return f"skipped, {unreachable}" if unreachable else None


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") != 1 or os.sep in name.replace("/", "", 1)


def resolve_model_dir(model: str | Path | None = None, progress: bool = False) -> Path:
    """The directory holding the Talker's config.json, safetensors and tokenizer.json."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a model directory or a Hugging Face repo id (str or Path), got "
                        f"{type(model).__name__}")
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
    blocker = download_blocker()
    if blocker:
        looked.append(f"download of {name}: {blocker}")
    else:
        (enable_progress_bars if progress else disable_progress_bars)()
        try:
            return Path(huggingface_hub.snapshot_download(name, allow_patterns=TALKER_FILES))
        except Exception as e:  # network, auth, unknown repo: all end in the one error below
            looked.append(f"download of {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise ModelNotFoundError(f"model {name} not found: " + "; ".join(looked) +
                             ". Give --model a local directory (higgs-rt make-random-checkpoint DIR makes a random one).")
