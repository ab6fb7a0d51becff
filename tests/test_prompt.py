"""Prompts: the golden strings, the rebuilt tokenizer against tiktoken, and text that cannot be a prompt."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.config import ConfigError
from higgs_rt.fixtures.tokenizer import LLAMA3_PATTERN, llama3_ranks_path, read_ranks
from higgs_rt.prompt import PromptBuilder, PromptError, check_budget

SCENE = "Audio is recorded from a quiet room."
TEXT = "The sun rises in the east."
GOLDEN_SCENE = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nGenerate audio following instruction.\n\n"
    "<|scene_desc_start|>\nAudio is recorded from a quiet room.\n<|scene_desc_end|><|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nThe sun rises in the east.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>")
GOLDEN_PLAIN = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nGenerate audio following instruction."
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThe sun rises in the east.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>")


@pytest.fixture(scope="module")
def builder(tokenizer_dir):
    return PromptBuilder(tokenizer_dir)


def golden_ids(builder, s: str) -> list[int]:
    """The whole golden string through `tokenizers` (the reference) with special tokens recognised."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(builder.path)).encode(s, add_special_tokens=False).ids


def test_golden_prompts(builder):
    assert builder.tts(TEXT, scene=SCENE).ids.tolist() == golden_ids(builder, GOLDEN_SCENE)
    plain = builder.tts(TEXT).ids.tolist()
    assert plain == golden_ids(builder, GOLDEN_PLAIN)
    assert plain[:5] == [128000, 128006, 9125, 128007, 271]  # "system" and "\n\n" as the real tokenizer has them
    assert plain[-1] == builder.special["<|audio_out_bos|>"] == 128013


def test_clone_prompt_layout(builder):
    ref = torch.zeros(12, 8, dtype=torch.long)
    ids = builder.clone(TEXT, "Hello there.", ref).ids.tolist()
    audio = builder.special["<|AUDIO_OUT|>"]
    first = ids.index(audio)
    assert ids.count(audio) == 12 and ids[first:first + 12] == [audio] * 12
    assert ids[first - 1] == builder.special["<|audio_out_bos|>"]
    assert ids[first + 12:first + 14] == [builder.special["<|audio_eos|>"], builder.special["<|eot_id|>"]]
    assert ids[-6:] == builder.tts(TEXT).ids.tolist()[-6:]


def test_tokenizer_matches_tiktoken():
    tiktoken = pytest.importorskip("tiktoken")
    ranks = read_ranks(llama3_ranks_path())
    enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    from tokenizers import Tokenizer

    from higgs_rt.fixtures.tokenizer import build_tokenizer_json
    import json

    tok = Tokenizer.from_str(json.dumps(build_tokenizer_json(ranks)))
    for s in ["Hello, world!", "  spaced   out\n\n\nlines\t", "Numbers 1234567 and 3.14159", "naïve café — ünïcödé",
              "日本語のテキスト", "emoji 🎉🎉 here", "it's they'll I'M", "a" * 50, "\r\n\r\nx"]:
        assert tok.encode(s, add_special_tokens=False).ids == enc.encode(s), s


def test_special_token_text_is_spoken_not_obeyed(builder):
    ids = builder.tts("Say <|eot_id|> literally.").ids.tolist()
    assert ids.count(builder.special["<|eot_id|>"]) == 2  # the system and user turns' own, not the text's


@pytest.mark.parametrize("text,msg", [("", "text is empty"), ("   \n", "text is empty"),
                                      ("\u200b", "only invisible"), (" \ufeff\u200b\x07 ", "only invisible"),
                                      ("[SPEAKER0] hi [SPEAKER1] yo", "multi-speaker"), (None, "must be a string")])
def test_bad_text(builder, text, msg):
    with pytest.raises(PromptError, match=msg):
        builder.tts(text)


def test_text_with_invisible_characters_beside_visible_ones_is_spoken(builder):
    assert builder.tts("\ufeffHi\u200bthere.").ids.numel() > builder.tts("Hi.").ids.numel()


def test_budget():
    check_budget(100, 1024, 4096)
    with pytest.raises(PromptError, match="exceeds the context of 4096"):
        check_budget(3100, 1024, 4096)
    with pytest.raises(ValueError, match="at least 9"):
        check_budget(10, 8, 4096)


def test_tokenizer_without_specials_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="lacks the special token"):
        PromptBuilder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        PromptBuilder(tmp_path / "nowhere")


def test_text_with_a_lone_surrogate_is_refused(builder):
    with pytest.raises(PromptError, match="not valid Unicode: a lone surrogate at character 3"):
        builder.tts("Hi \udcff there.")  # what the byte 0xff becomes, read with surrogateescape
