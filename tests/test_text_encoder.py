"""higgs_rt.text_encoder: the fast (tiktoken) path gives `tokenizers`' ids, its cache, and the fallbacks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from higgs_rt import text_encoder
from higgs_rt.prompt import SPECIALS
from higgs_rt.text_encoder import load_text_encoder

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

PIECES = ["a", "aa", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "0", "123", "4567", ".", "...", "!?", "=", "--",
          "é", "ü", "日本", "語", "🎉", "🙂", "ـ", "İ", "ı", "<|eot_id|>", "<|AUDIO_OUT|>", "Hello", " world", "it's"]


@pytest.fixture(scope="module")
def tokenizer_json(tokenizer_dir):
    return tokenizer_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def reference(tokenizer_json):
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    return lambda s: tok.encode(s, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def fast(tokenizer_json, tmp_path_factory):
    encoder = load_text_encoder(tokenizer_json, tmp_path_factory.mktemp("cache"))
    assert encoder.kind == "tiktoken"
    return encoder


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30).map("".join) | st.text(max_size=60))
def test_the_fast_path_gives_the_reference_ids(fast, reference, text):
    assert fast.encode(text) == reference(text)


def test_special_tokens_are_looked_up_and_their_names_in_text_are_text(fast, reference, tokenizer_json):
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    assert {name: fast.token_to_id(name) for name in SPECIALS} == {name: tok.token_to_id(name) for name in SPECIALS}
    ids = fast.encode("Say <|eot_id|> now")
    assert fast.token_to_id("<|eot_id|>") not in ids and ids == reference("Say <|eot_id|> now")


def test_the_second_load_reads_the_cache_not_tokenizer_json(tokenizer_json, tmp_path, monkeypatch):
    first = load_text_encoder(tokenizer_json, tmp_path)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".bpe", ".json"]

    def no_parse(_):
        raise AssertionError("tokenizer.json parsed again")

    monkeypatch.setattr(text_encoder, "_bpe_spec", no_parse)
    second = load_text_encoder(tokenizer_json, tmp_path)
    assert second.kind == "tiktoken" and second.encode("Hello there.") == first.encode("Hello there.")
    assert (first.how, second.how) == ("tiktoken, its ranks cached now", "tiktoken, from its cached ranks")


def test_a_damaged_cache_is_rebuilt(tokenizer_json, tmp_path, reference):
    load_text_encoder(tokenizer_json, tmp_path)
    bpe = next(tmp_path.glob("*.bpe"))
    bpe.write_bytes(bpe.read_bytes()[: 1000])  # cut short
    again = load_text_encoder(tokenizer_json, tmp_path)
    assert again.kind == "tiktoken" and again.encode("Hello there.") == reference("Hello there.")
    assert bpe.stat().st_size > 1000


def test_a_tokenizer_tiktoken_cannot_run_takes_tokenizers_and_is_checked_once(tokenizer_json, tmp_path,
                                                                            monkeypatch):
    spec = json.loads(tokenizer_json.read_text())
    spec["model"]["ignore_merges"] = False  # then merges, not whole-word tokens, decide: not rank-based
    other = tmp_path / "tokenizer.json"
    other.write_text(json.dumps(spec))
    assert load_text_encoder(other, tmp_path / "cache").kind == "tokenizers"
    assert not list((tmp_path / "cache").glob("*.bpe"))

    def no_check(_):
        raise AssertionError("checked again")

    monkeypatch.setattr(text_encoder, "_bpe_spec", no_check)
    encoder = load_text_encoder(other, tmp_path / "cache")  # the verdict is cached
    assert encoder.kind == "tokenizers"
    tok = tokenizers.Tokenizer.from_file(str(other))
    tok.encode_special_tokens = True
    assert encoder.encode("Hello, <|eot_id|> world") == tok.encode("Hello, <|eot_id|> world", add_special_tokens=False).ids


def test_an_unwritable_cache_still_encodes(tokenizer_json, tmp_path, reference):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    encoder = load_text_encoder(tokenizer_json, blocked / "cache")
    assert encoder.encode("Hello there.") == reference("Hello there.")


@pytest.mark.parametrize("content,words", [(b"not json", "Expecting value"),
                                            (b'{"model": {"type": "nope"}}', "did not match"),
                                            (b"[1, 2]", "")])
def test_a_tokenizer_json_that_is_not_one_is_a_one_line_error(tmp_path, content, words):
    from higgs_rt.text_encoder import TokenizerError

    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=f"{path} is not a usable tokenizer.json: .*{words}") as e:
        load_text_encoder(path, cache_dir=tmp_path / "cache")
    assert "\n" not in str(e.value)
