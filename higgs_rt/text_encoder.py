"""The prompt builder's text encoder: tokenizer.json's byte-level BPE, loaded in a fraction of the time.

`tokenizers` takes 0.6-0.8 s to load Higgs-Audio's tokenizer.json (2-core CPU; 0.65 s of the H200's 2.48 s cold
start): a 9 MB JSON and 280k merges. A Llama-3 tokenizer.json, byte-level BPE whose merges rank the tokens they
make in id order and whose whole-word tokens win (`ignore_merges`), one split regex, no normaliser, only special
added tokens, is exactly the rank-based BPE that tiktoken runs from the ids alone. `load_text_encoder` checks
those conditions once per tokenizer.json (by content hash), writes its ranks under $HIGGS_RT_HOME/tokenizers
(tiktoken's format), and later loads build a tiktoken encoder from that file. Any other tokenizer.json (the
cache remembers the verdict), no tiktoken, or no writable cache: `tokenizers`, as before. Either way text is
encoded as ordinary text: a special token's name in it is spoken, not obeyed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from .home import default_home

CACHE_FORMAT = "higgs-rt-bpe-1"


class TextEncoder:
    """encode(text) -> ids, with special tokens disabled; token_to_id(name) for the special tokens."""

    def __init__(self, encode, special: dict[str, int], kind: str):
        self.encode, self.special, self.kind = encode, special, kind
        self.how = kind  # for --verbose: the path taken, and whether the cache was written now

    def token_to_id(self, name: str) -> int | None:
        return self.special.get(name)


class TokenizerError(ValueError):
    """A tokenizer.json that cannot be loaded, with the reason in one line."""


def load_text_encoder(path: str | Path, cache_dir: str | Path | None = None) -> TextEncoder:
    """The encoder for tokenizer.json at `path` (see the module docstring); TokenizerError for one that is not a
    usable tokenizer (not JSON, not a tokenizer)."""
    try:
        return _load(Path(path), cache_dir)
    except (TokenizerError, OSError):
        raise
    except Exception as e:  # json's and the tokenizers package's errors about the file's content
        raise TokenizerError(f"{path} is not a usable tokenizer.json: {' '.join(str(e).split())[:200]}") from None


def _load(path: Path, cache_dir: str | Path | None) -> TextEncoder:
    data = path.read_bytes()
    cache = Path(cache_dir) if cache_dir is not None else default_home() / "tokenizers"
    stem = cache / hashlib.sha256(data).hexdigest()[:32]
    cached = _load_cached(stem)
    if isinstance(cached, TextEncoder):
        return cached
    if cached is _TOKENIZERS or importlib.util.find_spec("tiktoken") is None:
        return _tokenizers_encoder(path)
    spec = _bpe_spec(json.loads(data))
    if spec is not None:
        ranks, pattern, special = spec
        meta = {"pattern": pattern, "special": special, "ranks": len(ranks)}
        if _write_cache(stem, meta, ranks):
            fast = _tiktoken_encoder(stem.name, ranks, meta)  # the ranks in hand, not read back
            if fast is not None:
                fast.how = "tiktoken, its ranks cached now"
                return fast
    _write_cache(stem, {"tokenizers": True})  # later loads go straight to tokenizers, without the check
    return _tokenizers_encoder(path)


def _tokenizers_encoder(path: Path) -> TextEncoder:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True  # user text is text
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    return TextEncoder(lambda s: tokenizer.encode(s, add_special_tokens=False).ids, special, "tokenizers")


_TOKENIZERS = "tokenizers"  # the cache's verdict: this tokenizer.json is not for tiktoken


def _load_cached(stem: Path) -> TextEncoder | str | None:
    """The cached encoder, _TOKENIZERS, or None (no usable cache)."""
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        if meta.get("format") != CACHE_FORMAT:
            return None
        if meta.get("tokenizers"):
            return _TOKENIZERS
        ranks = {}
        for line in stem.with_suffix(".bpe").read_bytes().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no cache, or a bad one
        return None
    encoder = _tiktoken_encoder(stem.name, ranks, meta)
    if encoder is not None:
        encoder.how = "tiktoken, from its cached ranks"
    return encoder


def _tiktoken_encoder(name: str, ranks: dict[bytes, int], meta: dict) -> TextEncoder | None:
    """A tiktoken encoder of these ranks (None: no tiktoken, or metadata that does not fit them)."""
    try:
        import tiktoken

        if len(ranks) != meta["ranks"]:
            return None
        encoding = tiktoken.Encoding(f"higgs-rt-{name}", pat_str=meta["pattern"], mergeable_ranks=ranks,
                                     special_tokens={})
        return TextEncoder(encoding.encode_ordinary, meta["special"], "tiktoken")
    except (ImportError, ValueError, KeyError, TypeError):
        return None


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's table) back to bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in table.items()}


def _bpe_spec(spec: dict) -> tuple[dict[bytes, int], str, dict[str, int]] | None:
    """(ranks, split pattern, special tokens) if tokenizer.json is rank-based byte-level BPE; else None."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or not model.get("ignore_merges") or model.get("byte_fallback")
            or model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
            or spec.get("normalizer") is not None):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or "Regex" not in (split.get("pattern") or {})
            or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex")
            or byte_level.get("add_prefix_space")):
        return None
    added = spec.get("added_tokens") or []
    if not all(t.get("special") for t in added):
        return None  # a non-special added token splits text: not in tiktoken's model
    decode = _byte_decoder()
    try:
        ranks = {bytes(decode[c] for c in token): rank for token, rank in model["vocab"].items()}
    except KeyError:
        return None
    if len(ranks) != len(model["vocab"]):
        return None
    vocab, last = model["vocab"], -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        made = vocab.get(a + b)
        if made is None or made < last:
            return None  # merge order is not id order: not rank-based BPE (a token may have several merges)
        last = made
    return ranks, split["pattern"]["Regex"], {t["content"]: t["id"] for t in added}


def _write_cache(stem: Path, meta: dict, ranks: dict[bytes, int] | None = None) -> bool:
    """The ranks (tiktoken's format) and then the metadata, each written whole or not at all; True if both were.
    An unwritable cache only costs the fast path."""
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        files = [(".json", json.dumps({"format": CACHE_FORMAT, **meta}).encode())]
        if ranks is not None:
            lines = b"\n".join(base64.b64encode(token) + b" " + str(rank).encode() for token, rank in ranks.items())
            files.insert(0, (".bpe", lines + b"\n"))
        for suffix, body in files:
            fd, tmp = tempfile.mkstemp(dir=stem.parent, prefix=f".{stem.name}")
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, stem.with_suffix(suffix))
    except OSError:
        return False
    return True
