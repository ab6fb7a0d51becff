"""Shared pytest fixtures: tiny random checkpoints, built once per session.

Talker fixtures go through the oracle: the fixture tool writes a random checkpoint, transformers loads it
(strictly: no missing or unexpected keys) and `save_pretrained` writes the directory higgs-rt then loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

TINY_TALKERS = ("tiny", "tiny-mha")


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


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
