"""Where higgs-rt keeps its own files: $HIGGS_RT_HOME, else ~/.cache/higgs-rt (cloned voices, tokenizer caches,
unpacked AOTInductor packages)."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    return Path(os.environ.get("HIGGS_RT_HOME") or "~/.cache/higgs-rt").expanduser()
