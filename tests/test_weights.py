"""Config and weight loading: both layouts, fusing, dtype casts, and clear errors on bad checkpoints."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from higgs_rt.config import ConfigError, TalkerConfig
from higgs_rt.talker import Talker
from higgs_rt.weights import WeightsError, load_talker_weights


@pytest.fixture
def hf_copy(talker_dirs, tmp_path):
    src = talker_dirs["tiny"][0]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_both_layouts_read_to_one_config(talker_dirs):
    hf, boson, _ = talker_dirs["tiny"]
    a, b = TalkerConfig.from_dir(hf), TalkerConfig.from_dir(boson)
    assert (a.layout, b.layout) == ("transformers", "boson")
    differ = {f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f)}
    assert differ == {"layout", "rope_scaling", "audio_delay_token_id", "extra"}
    # the two spellings of llama3's RoPE factors give the same frequencies
    from higgs_rt.talker import rope_frequencies
    assert torch.allclose(rope_frequencies(128, a.rope_theta, a.rope_scaling),
                          rope_frequencies(128, b.rope_theta, b.rope_scaling), rtol=1e-12, atol=0)
    assert a.num_codes == 16 and a.codebook_vocab == 18 and a.stream_bos_id == 16 and a.num_kv_heads == 2


def test_text_head_is_skipped_and_qkv_fused(talker_dirs):
    _, boson, _ = talker_dirs["tiny"]
    cfg = TalkerConfig.from_dir(boson)
    w = load_talker_weights(boson, cfg)
    assert not any("text" in k for k in w)
    raw = {}
    for f in boson.glob("*.safetensors"):
        raw.update(load_file(f))
    assert "audio_decoder_proj.text_lm_head.weight" in raw
    want = torch.cat([raw[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(w["layers.0.wqkv"], want)


def test_dtype_cast(talker_dirs):
    model = Talker.from_pretrained(talker_dirs["tiny"][0], dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.layers[0].wqkv.weight.dtype == torch.bfloat16


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_and_unexpected_keys_are_listed(hf_copy):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.surprise.weight"] = torch.zeros(2)

    _rewrite(hf_copy, edit)
    with pytest.raises(WeightsError, match=r"missing 1 key\(s\): layers.1.mlp.up_proj.weight; "
                                           r"unexpected 1 key\(s\): layers.1.surprise.weight"):
        Talker.from_pretrained(hf_copy)


@pytest.mark.parametrize("layers", [3, 2**31 - 1])
def test_a_layer_count_the_checkpoint_lacks_is_one_error_at_once(hf_copy, layers):
    """num_hidden_layers=2**31-1 over a 2-layer checkpoint listed the missing keys only after building names for
    every layer (gigabytes, minutes); the count is compared first."""
    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    with pytest.raises(WeightsError, match=rf"hold 2 layer\(s\), the config's num_hidden_layers is {layers}$"):
        Talker.from_pretrained(hf_copy)


def test_wrong_shape_names_the_key(hf_copy):
    _rewrite(hf_copy, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(WeightsError, match=r"norm.weight has shape \(3,\)"):
        Talker.from_pretrained(hf_copy)


def test_corrupt_and_absent_files(hf_copy):
    (hf_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="cannot read"):
        Talker.from_pretrained(hf_copy)
    (hf_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        Talker.from_pretrained(hf_copy)


def test_missing_shard_named_by_index(talker_dirs, tmp_path):
    dst = tmp_path / "boson"
    shutil.copytree(talker_dirs["tiny"][1], dst)
    next(dst.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightsError, match="shard\\(s\\) named by the index are missing"):
        Talker.from_pretrained(dst)


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c.update(model_type="llama"), "not a Higgs-Audio v2 Talker"),
    (lambda c: c.update(num_attention_heads=3), "not a multiple"),
    (lambda c: c.update(audio_stream_bos_id=5), "stream BOS/EOS ids"),
    (lambda c: c.pop("codebook_size"), "missing field 'codebook_size'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope type 'yarn'"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
])
def test_bad_configs(hf_copy, edit, msg):
    cfg = json.loads((hf_copy / "config.json").read_text())
    edit(cfg)
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=msg) as caught:
        TalkerConfig.from_dir(hf_copy)
    assert str(caught.value).startswith(f"{hf_copy / 'config.json'}: config"), str(caught.value)  # names the file


def test_unreadable_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        TalkerConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        TalkerConfig.from_dir(tmp_path)


def test_boson_config_rejects_partial_dual_ffn(talker_dirs, tmp_path):
    cfg = json.loads((talker_dirs["tiny"][1] / "config.json").read_text())
    cfg["audio_dual_ffn_layers"] = [0]
    with pytest.raises(ConfigError, match="every layer"):
        TalkerConfig.from_dict(cfg)


# ---------------------------------------------------------------- cold start: each weight written once


def _file_mappings(path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of `path` (/proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_cpu_weights_in_the_checkpoints_dtype_are_the_memory_map_itself(talker_dirs):
    """On the CPU, a parameter that is one checkpoint tensor in its dtype is a view of the memory-mapped file (no
    copy at load); fused q/k/v and gate/up are one new tensor each."""
    hf = talker_dirs["tiny"][0]
    cfg = TalkerConfig.from_dir(hf)
    model = Talker.from_pretrained(hf, dtype=torch.float32)  # the tiny checkpoint is float32
    maps = _file_mappings((hf / "model.safetensors").resolve())
    assert maps, "the checkpoint is not memory-mapped"

    def mapped(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in maps)

    params = dict(model.named_parameters())
    fused = {n for n in params if n.endswith(("wqkv.weight", "w13.weight"))}
    assert len(fused) == 3 * cfg.num_layers
    assert all(mapped(t) for n, t in params.items() if n not in fused)
    assert not any(mapped(params[n]) for n in fused)
    # another dtype: every parameter is converted once, none left in the map
    model16 = Talker.from_pretrained(hf, dtype=torch.bfloat16)
    assert not any(mapped(t) for t in model16.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_copies_equal_direct_ones(talker_dirs, dtype):
    """The chunked path that CUDA loads take (pinned staging buffers there), run on the CPU with chunks that split
    tensors at odd places: the same weights, bit for bit, as the direct path, in both layouts and dtypes."""
    from safetensors import safe_open

    from higgs_rt.weights import DeviceWriter, map_weights

    for d in talker_dirs["tiny"][:2]:
        cfg = TalkerConfig.from_dir(d)
        direct = load_talker_weights(d, cfg, dtype=dtype)
        tensors = {}
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in d.glob("*.safetensors")]
        for f in handles:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
        writer = DeviceWriter(torch.device("cpu"), staged=True, chunk_bytes=1000)
        chunked = map_weights(tensors, cfg, dtype, writer=writer)
        fused_bytes = sum(t.numel() * t.element_size() for n, t in direct.items() if "wqkv" in n or "w13" in n)
        if dtype == torch.float32:  # the checkpoint's dtype: only the fused parameters are copied
            assert writer.bytes == fused_bytes * 1 and writer.shared == len(direct) - 3 * cfg.num_layers
        else:  # every tensor is copied (and cast) once, in chunks
            assert writer.bytes == 2 * sum(t.numel() * t.element_size() for t in direct.values())
            assert writer.shared == 0
        assert direct.keys() == chunked.keys()
        for name in direct:
            assert chunked[name].dtype == dtype and torch.equal(direct[name], chunked[name]), name


# ---------------------------------------------------------------- corrupt values: NaN, inf, integers


@pytest.mark.parametrize("key,value", [
    ("model.layers.0.audio_input_layernorm.weight", float("nan")),  # QA's repro: 40 s of full-scale noise, exit 0
    ("model.layers.1.self_attn.k_proj.weight", float("-inf")),  # one piece of a fused parameter: named itself
    ("model.embed_tokens.weight", float("inf")),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # used in place / cast on the device
def test_a_weight_holding_nan_or_inf_is_refused_naming_key_and_file(hf_copy, key, value, dtype):
    _rewrite(hf_copy, lambda t: t[key].view(-1).__setitem__(3, value))
    with pytest.raises(WeightsError) as caught:
        Talker.from_pretrained(hf_copy, dtype=dtype)
    assert str(caught.value) == (f"weights: {key} in {hf_copy / 'model.safetensors'} holds NaN or infinite values: "
                                 "the checkpoint is corrupt")


def test_nan_is_found_on_the_staged_path_too_and_every_bad_tensor_counted(talker_dirs):
    """The chunked path CUDA loads take (run on the CPU): the check sees what landed in the parameters."""
    from higgs_rt.weights import DeviceWriter, map_weights

    hf = talker_dirs["tiny"][0]
    cfg = TalkerConfig.from_dir(hf)
    tensors = load_file(hf / "model.safetensors")
    for key in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        tensors[key][-1] = float("nan")
    writer = DeviceWriter(torch.device("cpu"), staged=True, chunk_bytes=1000)
    with pytest.raises(WeightsError, match=r"^weights: model.norm.weight in the state dict holds NaN or infinite "
                                           r"values \(and 1 more of the \d+ tensors\): the checkpoint is corrupt$"):
        map_weights(tensors, cfg, torch.bfloat16, writer=writer)


def test_an_integer_weight_is_refused_naming_key_dtype_and_kind(hf_copy):
    """QA's repro stored every tensor as int32: it was cast to float and spoke."""
    key = "model.layers.1.mlp.down_proj.weight"
    _rewrite(hf_copy, lambda t: t.update({key: t[key].to(torch.int32)}))
    with pytest.raises(WeightsError) as caught:
        Talker.from_pretrained(hf_copy)
    assert str(caught.value) == (f"weights: {key} in {hf_copy / 'model.safetensors'} is stored as int32, where a "
                                 "floating-point tensor is expected")


def test_a_corrupt_checkpoint_is_exit_1_and_one_line(random_model, tmp_path, capsys):
    from higgs_rt.cli import main

    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    key = "model.layers.0.audio_input_layernorm.weight"
    _rewrite(model, lambda t: t[key].fill_(float("nan")))
    assert main(["speak", "Hello there.", "--model", str(model), "--out", str(tmp_path / "o.wav")]) == 1
    assert capsys.readouterr().err == (f"higgs-rt: error: weights: {key} in {model / 'model.safetensors'} holds NaN "
                                       "or infinite values: the checkpoint is corrupt\n")
    assert not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("raw,msg", [
    (b"[1, 2]", "must hold a JSON object, got list"),
    (b"null", "must hold a JSON object, got NoneType"),
    (b'{"model_type": "\xff"}', "is not valid JSON ('utf-8' codec can't decode"),
    (b"[" * 100000 + b"]" * 100000, "is not valid JSON"),
])
def test_a_config_that_is_not_a_json_object_is_a_config_error(tmp_path, raw, msg):
    """config.json holding a list or null was an AttributeError traceback; bytes that are not UTF-8 a bare
    UnicodeDecodeError (exit 2, naming no file)."""
    (tmp_path / "config.json").write_bytes(raw)
    with pytest.raises(ConfigError, match=f"config: {tmp_path / 'config.json'} {re.escape(msg)}"):
        TalkerConfig.from_dir(tmp_path)


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c.update(hidden_size="64"), 'config: hidden_size must be an integer, got "64"'),
    (lambda c: c.update(hidden_size=None), "config: hidden_size must be an integer, got null"),
    (lambda c: c.update(hidden_size=64.5), "config: hidden_size must be an integer, got 64.5"),
    (lambda c: c.update(hidden_size=float("inf")), "config: hidden_size must be an integer, got Infinity"),
    (lambda c: c.update(num_hidden_layers=[2]), "config: num_hidden_layers must be an integer, got [2]"),
    (lambda c: c.update(audio_token_id=True), "config: audio_token_id must be an integer, got true"),
    (lambda c: c.update(audio_delay_token_id="x"), 'config: audio_delay_token_id must be an integer, got "x"'),
    (lambda c: c.update(rms_norm_eps="x"), 'config: rms_norm_eps must be a finite number, got "x"'),
    (lambda c: c.update(rms_norm_eps=10**400), "config: rms_norm_eps must be a finite number"),
    (lambda c: c.update(rope_parameters=[1]), "config: rope_parameters must be an object, got [1]"),
    (lambda c: c["rope_parameters"].update(rope_theta="x"), 'config: rope_theta must be a finite number, got "x"'),
    (lambda c: c["rope_parameters"].update(rope_theta=-5.0), "config: rope_theta must be above 1, got -5.0"),
    # finite, in no sane range: inf frequencies (NaN rotations) or an fp32-inf epsilon, silently
    (lambda c: c["rope_parameters"].update(rope_theta=1e-320), "config: rope_theta must be above 1, got 1e-320"),
    (lambda c: c["rope_parameters"].update(rope_theta=1.0), "config: rope_theta must be above 1, got 1.0"),
    (lambda c: c["rope_parameters"].update(factor=1e-320), "config: llama3 rope parameters need factor >= 1"),
    (lambda c: c.update(rms_norm_eps=1e300), "config: rms_norm_eps must be in (0, 1), got 1e+300"),
    (lambda c: c["rope_parameters"].update(factor=None), "config: rope factor must be a finite number, got null"),
    (lambda c: c["rope_parameters"].update(factor=0), "config: llama3 rope parameters need factor >= 1"),
    (lambda c: c["rope_parameters"].update(high_freq_factor=c["rope_parameters"]["low_freq_factor"]),
     "0 < low_freq_factor < high_freq_factor"),
    (lambda c: c["rope_parameters"].update(original_max_position_embeddings=0),
     "original_max_position_embeddings in [1, 2147483647]"),
    # in range one by one, absurd as values: sizes past any tensor, zeros that were silently read as defaults
    (lambda c: c["rope_parameters"].update(original_max_position_embeddings=2**64),
     "original_max_position_embeddings in [1, 2147483647]"),
    (lambda c: c.update(hidden_size=2**31), "config: hidden_size must be an integer in [1, 2147483647], got 2147483648"),
    (lambda c: c.update(num_hidden_layers=1e308), "config: num_hidden_layers must be an integer in [1, 2147483647]"),
    (lambda c: c.update(vocab_size=-1), "config: vocab_size must be an integer in [1, 2147483647], got -1"),
    (lambda c: c.update(head_dim=0), "config: head_dim must be an integer in [1, 2147483647], got 0"),
    (lambda c: c.update(num_key_value_heads=0), "config: num_key_value_heads must be an integer in [1, 2147483647]"),
    # token ids outside the embedding: an IndexError or OverflowError mid-synthesis before
    (lambda c: c.update(audio_token_id=128256), "config: audio_token_id 128256 is not a token id of the 128256-token"),
    (lambda c: c.update(audio_delay_token_id=-1), "config: audio_delay_token_id -1 is not a token id of the 128256"),
    (lambda c: c.update(audio_delay_token_id=2**64), "config: audio_delay_token_id 18446744073709551616 is not a "),
])
def test_config_fields_of_the_wrong_type_or_value_name_the_field(hf_copy, edit, msg):
    """A field of the wrong type was int()/float()'s bare error (exit 2, no field named), an OverflowError
    traceback (infinity), or taken silently (64.5 read as 64, a string delay token id, rope parameters that
    divide by zero or give negative frequencies)."""
    cfg = json.loads((hf_copy / "config.json").read_text())
    edit(cfg)
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(msg)):
        TalkerConfig.from_dir(hf_copy)


@pytest.mark.parametrize("edit,message", [
    # holds <|AUDIO_OUT|> (config.json alone is fine), not the scene description's tokens
    (dict(vocab_size=128017), "vocab_size 128017 does not hold the tokenizer's <|scene_desc_end|> (128019): "
                              "tokenizer and model do not belong together"),
    (dict(audio_delay_token_id=128013), "audio_delay_token_id 128013 is the tokenizer's <|audio_out_bos|>, which "
                                        "prompts use as text, not audio"),
])
def test_token_ids_the_tokenizer_contradicts_are_a_config_error_at_load(random_model, tmp_path, edit, message):
    """A vocabulary too small for the tokenizer's ids was an IndexError in the embedding at a synthesis with a scene; an
    audio delay id that is a prompt's special token a ValueError (an audio position without a frame) there."""
    from higgs_rt.model import Model

    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    if "vocab_size" in edit:  # weights that match the smaller vocabulary
        tensors = load_file(model / "model.safetensors")
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:edit["vocab_size"]].clone()
        save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(ConfigError) as caught:
        Model(model, device="cpu")
    assert str(caught.value) == f"{model / 'config.json'}: {message}"


def test_a_tokenizer_of_another_model_is_exit_1_like_a_bad_config(random_model, tmp_path, capsys):
    """The tokenizer's <|AUDIO_OUT|> differing from config.json's audio_token_id was a PromptError: exit 2, as if
    the user's text were bad. It is the checkpoint's fault: a ConfigError, exit 1."""
    from higgs_rt.cli import main

    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "audio_token_id": 5}))
    assert main(["speak", "Hi.", "--model", str(model), "--out", str(tmp_path / "hi.wav")]) == 1
    assert capsys.readouterr().err == (f"higgs-rt: error: the tokenizer's <|AUDIO_OUT|> is "
                                       f"{config['audio_token_id']} but the model expects 5: tokenizer and model do "
                                       "not belong together\n")


def test_boson_config_fields_of_the_wrong_type_name_the_field(talker_dirs):
    cfg = json.loads((talker_dirs["tiny"][1] / "config.json").read_text())
    for edit, msg in [(dict(text_config=[]), "config: text_config must be an object, got []"),
                      (dict(audio_dual_ffn_layers="01"), "every layer"),
                      (dict(audio_dual_ffn_layers=[0, "1"]), "every layer"),
                      # a MemoryError (or an OverflowError) building range(num_hidden_layers) before
                      (dict(text_config={**cfg["text_config"], "num_hidden_layers": 2**31 - 1}), "every layer"),
                      (dict(text_config={**cfg["text_config"], "num_hidden_layers": 2**63}),
                       "config.text_config: num_hidden_layers must be an integer in [1, 2147483647], got 92233720"),
                      (dict(audio_codebook_size="16"), 'config: audio_codebook_size must be an integer, got "16"')]:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            TalkerConfig.from_dict({**cfg, **edit})
