"""Chat-template prompts rendered to token ids with the model's own tokenizer (tokenizer.json).

Plain TTS:   system turn (optionally with a scene description), user turn with the text, then the assistant
             header and `<|audio_out_bos|>`, after which the Talker emits audio frames.
Voice clone: the reference transcript as a user turn and the reference codes as an assistant audio turn come
             between the system turn and the target text (`clone_prompt`).
Special tokens are looked up by name in the tokenizer; user text is encoded with special tokens disabled, so a
text that contains "<|eot_id|>" is spoken, not obeyed.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .config import ConfigError

SYSTEM = "Generate audio following instruction."
SPEAKER_TAG = re.compile(r"\[SPEAKER\d+\]", re.IGNORECASE)
SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|audio_out_bos|>",
            "<|audio_eos|>", "<|AUDIO_OUT|>", "<|scene_desc_start|>", "<|scene_desc_end|>")


class PromptError(ValueError):
    """Text that cannot become a prompt, with the reason in one line."""


@dataclass
class Prompt:
    """Token ids [T] and the audio frames [N, Q] for its N audio positions (None for plain TTS)."""

    ids: Tensor
    audio_frames: Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])


class PromptBuilder:
    def __init__(self, tokenizer_path: str | Path, audio_token_id: int | None = None):
        from .text_encoder import load_text_encoder

        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = path
        self.encoder = load_text_encoder(path)  # text as text: a special token's name in it is spoken
        self.special = {}
        for name in SPECIALS:
            tid = self.encoder.token_to_id(name)
            if tid is None:
                raise ConfigError(f"the tokenizer at {path} lacks the special token {name}")
            self.special[name] = tid
        if audio_token_id is not None and audio_token_id != self.special["<|AUDIO_OUT|>"]:
            raise ConfigError(f"the tokenizer's <|AUDIO_OUT|> is {self.special['<|AUDIO_OUT|>']} but the model "
                              f"expects {audio_token_id}: tokenizer and model do not belong together")

    def _text(self, s: str) -> list[int]:
        return self.encoder.encode(s)

    def _render(self, parts: list) -> list[int]:
        """Parts are special-token names (in SPECIALS) or plain text. Text between two special tokens is
        encoded as one string, as the tokenizer itself splits a whole prompt (".\n\n" is one token)."""
        ids: list[int] = []
        text = ""
        for part in parts + ["<|eot_id|>"]:
            if part in self.special:
                ids.extend(self._text(text) if text else [])
                ids.append(self.special[part])
                text = ""
            else:
                text += part
        return ids[:-1]

    def _system(self, scene: str | None) -> list:
        parts = ["<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>", "\n\n" + SYSTEM]
        if scene is not None:
            parts += ["\n\n", "<|scene_desc_start|>", "\n" + check_text(scene, "scene") + "\n", "<|scene_desc_end|>"]
        return parts + ["<|eot_id|>"]

    def _turn(self, role: str, text: str) -> list:
        return ["<|start_header_id|>", role, "<|end_header_id|>", "\n\n" + text, "<|eot_id|>"]

    def _generation_start(self) -> list:
        return ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n", "<|audio_out_bos|>"]

    def turn_tokens(self, text: str, what: str = "text") -> int:
        """The tokens `text` takes as a turn's text in a prompt: a reference transcript's share of a clone
        prompt."""
        return len(self._text("\n\n" + check_text(text, what))) - len(self._text("\n\n"))

    def tts(self, text: str, scene: str | None = None) -> Prompt:
        """Plain TTS: system (+ scene), user text, assistant header and <|audio_out_bos|>."""
        parts = self._system(scene) + self._turn("user", check_text(text)) + self._generation_start()
        return Prompt(torch.tensor(self._render(parts), dtype=torch.long))

    def clone(self, text: str, ref_text: str, ref_frames: Tensor, scene: str | None = None) -> Prompt:
        """Voice clone: reference transcript and delayed reference frames [N, Q] before the target text."""
        n = ref_frames.shape[0]
        audio_turn = ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n", "<|audio_out_bos|>"] + \
            ["<|AUDIO_OUT|>"] * n + ["<|audio_eos|>", "<|eot_id|>"]
        parts = (self._system(scene) + self._turn("user", check_text(ref_text, "reference transcript"))
                 + audio_turn + self._turn("user", check_text(text)) + self._generation_start())
        return Prompt(torch.tensor(self._render(parts), dtype=torch.long), ref_frames)


def _visible(c: str) -> bool:
    """Neither space nor a control, format or other invisible character (Unicode categories Z* and C*)."""
    return unicodedata.category(c)[0] not in "ZC"


def check_unicode(text: str, what: str = "text") -> None:
    """No lone surrogate (what undecodable bytes become under surrogateescape, and the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{what} is not valid Unicode: a lone surrogate at character {e.start}") from None


def check_text(text: str, what: str = "text") -> str:
    if not isinstance(text, str):
        raise PromptError(f"{what} must be a string, got {type(text).__name__}")
    check_unicode(text, what)
    text = text.strip()
    if not any(_visible(c) for c in text):  # also U+200B, U+FEFF, controls: nothing to speak
        raise PromptError(f"{what} is empty" + (" (only invisible characters)" if text else ""))
    if SPEAKER_TAG.search(text):
        raise PromptError(f"{what} contains a [SPEAKERn] tag: multi-speaker dialogue is not supported yet")
    return text


def check_budget(prompt_len: int, max_frames: int, context: int) -> None:
    """The KV cache holds prompt + generated frames; say so plainly when they cannot fit."""
    if max_frames < 9:
        raise ValueError(f"max_frames must be at least 9 (the delay pattern needs 8 frames before the first "
                         f"audio frame), got {max_frames}")  # the parameter table refuses it first
    if prompt_len + max_frames > context:
        raise PromptError(f"the prompt ({prompt_len} tokens) plus max_frames ({max_frames}) exceeds the context "
                          f"of {context} positions: shorten the text or lower max_frames")
