"""higgs_rt.codec against transformers' HiggsAudioV2TokenizerModel (the oracle) on tiny random codecs.

Covers: decode parity and lengths, the Talker post-processing (vs transformers' processor), the Boson layout,
the receptive field, config and checkpoint errors, and where checkpoints are looked for. Streaming:
tests/test_codec_stream.py. The tiny codec fixtures are in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from higgs_rt.codec import (
    CodecCheckpointError,
    CodecConfig,
    CodecNotFoundError,
    load_codec,
    receptive_field,
    resolve_codec_dir,
)
from higgs_rt.codec.load import ENV_VARS, REPO_ID
from higgs_rt.config import ConfigError
from higgs_rt.fixtures.codec import build_oracle, delayed_frames
from higgs_rt.resample import install_torchaudio_standin

install_torchaudio_standin()
from transformers.models.higgs_audio_v2.processing_higgs_audio_v2 import HiggsAudioV2Processor  # noqa: E402

K, Q, HOP = 16, 8, 960
TOL = 1e-5


# ----------------------------------------------------------------------------- session fixtures


@pytest.fixture(scope="session")
def oracle(tiny_codec_dirs):
    return build_oracle(tiny_codec_dirs["transformers"])


@pytest.fixture(scope="session")
def codec(tiny_codec):
    return tiny_codec


@pytest.fixture(autouse=True)
def _no_codec_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def reference_decode(oracle, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return oracle.decode(codes.transpose(1, 2)).audio_values[:, 0]


def random_codes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, K, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- offline decode


def test_fixture_codec_is_really_random(oracle):
    a, b = random_codes(1, 12, Q, seed=1), random_codes(1, 12, Q, seed=2)
    wav_a = reference_decode(oracle, a)
    assert (wav_a - reference_decode(oracle, b)).abs().max() > 0.1
    last_codebook_changed = a.clone()
    last_codebook_changed[..., Q - 1] = (a[..., Q - 1] + 1) % K
    assert (wav_a - reference_decode(oracle, last_codebook_changed)).abs().max() > 1e-3
    assert 0.05 < wav_a.std() < 5


@pytest.mark.parametrize("frames", [1, 2, 7, 26])
def test_decode_matches_oracle(codec, oracle, frames):
    codes = random_codes(2, frames, Q, seed=frames)
    wav = codec.decode(codes)
    assert wav.shape == (2, frames * HOP) and wav.dtype == torch.float32
    assert (wav - reference_decode(oracle, codes)).abs().max() <= TOL


def test_decode_properties_and_input_checks(codec):
    assert (codec.sample_rate, codec.hop_length, codec.num_quantizers, codec.codebook_size) == (24000, HOP, Q, K)
    assert codec.decode(torch.zeros(3, 0, Q, dtype=torch.int64)).shape == (3, 0)
    with pytest.raises(ValueError, match="int64"):
        codec.decode(torch.zeros(1, 4, Q - 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        codec.decode(torch.zeros(1, 4, Q, dtype=torch.int32))


# ----------------------------------------------------------------------------- Talker post-processing


def processor_stub(oracle):
    """Just what HiggsAudioV2Processor's batch_decode / build_delay_pattern use, with the tiny codec's ids."""
    stub = SimpleNamespace(audio_stream_bos_id=K, audio_stream_eos_id=K + 1, audio_tokenizer=oracle)
    stub.revert_delay_pattern = lambda ids: HiggsAudioV2Processor.revert_delay_pattern(stub, ids)
    return stub


def reference_delayed(stub, codes: torch.Tensor) -> torch.Tensor:
    """transformers' own delay pattern: [T, Q] aligned -> [T + Q + 1, Q] with the BOS and EOS frames."""
    with_markers = torch.cat([torch.full((Q, 1), K), codes.T, torch.full((Q, 1), K + 1)], 1)
    return HiggsAudioV2Processor.build_delay_pattern(stub, with_markers[None])[0].T


def test_delayed_frames_helper_matches_transformers(oracle):
    codes = random_codes(11, Q, seed=3)
    assert torch.equal(delayed_frames(codes, K), reference_delayed(processor_stub(oracle), codes))


def test_postprocess_and_decode_match_processor(codec, oracle):
    stub = processor_stub(oracle)
    prompt = reference_delayed(stub, random_codes(5, Q, seed=4))  # a voice-clone reference, all-BOS frame first
    rows = []
    for frames, seed in ((13, 5), (6, 6)):
        generated = reference_delayed(stub, random_codes(frames, Q, seed=seed))
        generated[5:7, :2] = K + 1  # EOS in low codebooks amid data (ramp-out): both paths clip it
        rows.append(torch.cat([prompt, generated]))
    width = max(len(r) for r in rows) + 3  # padded with EOS frames, as the processor pads
    batch = torch.stack([torch.cat([r, torch.full((width - len(r), Q), K + 1)]) for r in rows])

    expected = HiggsAudioV2Processor.batch_decode(stub, batch)
    aligned = codec.postprocess(batch)
    assert [len(a) for a in aligned] == [13, 6]
    assert torch.equal(codec.postprocess(batch[1]), aligned[1])
    for codes, want in zip(aligned, expected):
        assert codes.min() >= 0 and codes.max() < K
        assert (codec.decode(codes[None])[0] - want).abs().max() <= TOL


def test_postprocess_short_input_gives_no_frames(codec):
    assert codec.postprocess(torch.full((4, Q), K)).shape == (0, Q)


# ----------------------------------------------------------------------------- Boson layout


def test_boson_layout_decodes_like_transformers_layout(tiny_codec_dirs, codec, oracle):
    boson_dir = tiny_codec_dirs["boson"]
    (boson_dir / "model.safetensors").write_bytes(b"the Talker copy lives here; never read it")
    boson = load_codec(boson_dir)
    assert boson.config.layout == "boson"
    codes = random_codes(2, 9, Q, seed=7)
    # weight norm refolded to fp32 differs from the plain weights by an ulp here and there
    assert (boson.decode(codes) - reference_decode(oracle, codes)).abs().max() <= 2 * TOL


def test_boson_fixture_uses_boson_key_names(tiny_codec_dirs):
    keys = set(torch.load(tiny_codec_dirs["boson"] / "model.pth", weights_only=True))
    # names from transformers' convert_higgs_audio_v2_tokenizer_to_hf.py mapping, written out by hand
    for key in ("decoder_2.model.0.weight_g", "decoder_2.model.0.weight_v", "decoder_2.model.1.block.0.alpha",
                "decoder_2.model.1.block.1.weight_v", "decoder_2.model.2.block.4.block.3.weight_g",
                "decoder_2.model.6.alpha", "decoder_2.model.7.bias", "quantizer.vq.layers.7._codebook.embed",
                "quantizer.vq.layers.0.project_out.weight", "fc_post2.weight", "encoder.block.1.block.4.weight_g",
                "encoder_semantic.conv.conv.weight"):
        assert key in keys, key
    assert not any(k.startswith(("acoustic_", "fc2.")) or k.endswith("decoder_2.model.0.weight") for k in keys)


# ----------------------------------------------------------------------------- receptive field


def test_receptive_field_is_tight(codec):
    left, right = receptive_field(codec.config)
    assert (left, right) == (10, 10)
    frames, probe = 41, 20
    codes = random_codes(1, frames, Q, seed=13)
    changed = codes.clone()
    changed[0, probe] = (codes[0, probe] + 1) % K
    diff = (codec.decode(codes) - codec.decode(changed)).abs().reshape(frames, HOP).amax(1)
    touched = (diff > 0).nonzero().flatten()
    # output frame t reads latent frames t - left .. t + right, so latent `probe` reaches probe - right .. probe + left
    assert touched.min() == probe - right and touched.max() == probe + left


# ----------------------------------------------------------------------------- config and checkpoint errors


def test_config_reads_both_layouts(tiny_codec_dirs):
    a, b = (CodecConfig.from_dir(tiny_codec_dirs[layout]) for layout in ("transformers", "boson"))
    assert a.layout == "transformers" and b.layout == "boson"
    fields = ("sample_rate", "upsampling_ratios", "decoder_channels", "latent_dim", "hidden_dim", "codebook_dim",
              "codebook_size", "num_quantizers")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    real_boson = {"n_filters": 32, "D": 256, "codebook_dim": 64, "target_bandwidths": [0.5, 1, 1.5, 2, 4],
                  "ratios": [8, 5, 4, 2, 3], "sample_rate": 24000, "bins": 1024, "n_q": 8,
                  "semantic_techer": "hubert_base_general"}
    full = CodecConfig.from_dict(real_boson)
    assert (full.hop_length, full.hidden_dim, full.decoder_channels, full.num_quantizers) == (960, 1024, 1024, 8)


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "higgs_audio_v2", "codebook_size": 1026}, "not a Higgs-Audio v2 codec config"),
    ({"model_type": "dac"}, "not a Higgs-Audio v2 codec config"),
    ({"D": 256, "ratios": [8, 5, 4, 2, 3], "bins": [8, 5, 5, 5], "n_q": 8, "codebook_dim": 64}, "RFSQ"),
    ({"model_type": "higgs_audio_v2_tokenizer",
      "acoustic_model_config": {"downsampling_ratios": [8, 5, 4, 2, 3], "upsampling_ratios": [8, 5, 4, 2]}},
     "different hop lengths"),
    ({"D": 256, "ratios": [8, 5, 4, 2, 3], "bins": 1024, "n_q": 0, "codebook_dim": 64}, "n_q must be an integer"),
])
def test_bad_configs_are_rejected(raw, message):
    with pytest.raises(ConfigError, match=message):
        CodecConfig.from_dict(raw)


@pytest.mark.parametrize("layout,edit,message", [
    ("transformers", dict(sample_rate="24000"), 'sample_rate must be an integer, got "24000"'),
    ("transformers", dict(sample_rate=10**400), "sample_rate must be an integer in [1, 2147483647], got 1000"),
    ("transformers", dict(codebook_dim=None), "codebook_dim must be an integer, got null"),
    ("transformers", dict(target_bandwidths="x"), 'target_bandwidths must be a non-empty list, got "x"'),
    ("transformers", dict(acoustic_model_config=[1]), "acoustic_model_config must be an object, got [1]"),
    ("transformers", dict(acoustic_model_config={"upsampling_ratios": ["a", "b"]}),
     'acoustic_model_config.upsampling_ratios must be an integer, got "a"'),
    ("transformers", dict(acoustic_model_config={"upsampling_ratios": [8, 0], "downsampling_ratios": [8, 0]}),
     "acoustic_model_config.upsampling_ratios must be an integer in [1, 2147483647], got 0"),
    ("transformers", dict(semantic_model_config={"hidden_size": "x"}),
     'semantic_model_config.hidden_size must be an integer, got "x"'),
    ("transformers", dict(sample_rate=2), "sample_rate must be from 8000 to 192000 Hz, got 2"),
    ("boson", dict(sample_rate=3), "sample_rate must be from 8000 to 192000 Hz, got 3"),
    ("boson", dict(sample_rate=384000), "sample_rate must be from 8000 to 192000 Hz, got 384000"),
    ("boson", dict(D="256"), 'D must be an integer, got "256"'),
    ("boson", dict(vq_scale=0), "vq_scale must be an integer in [1, 2147483647], got 0"),
    ("boson", dict(ratios=None), "ratios must be a non-empty list, got null"),
    # read by the encode path (voice cloning) only
    ("transformers", dict(kernel_size="3"), 'kernel_size must be an integer, got "3"'),
    ("transformers", dict(semantic_model_config={"conv_bias": "false"}),
     'semantic_model_config.conv_bias must be true or false, got "false"'),
    ("transformers", dict(semantic_model_config={"layer_norm_eps": 1e300}),
     "semantic_model_config.layer_norm_eps must be in (0, 1), got 1e+300"),
])
def test_config_fields_of_the_wrong_type_are_a_config_error_naming_field_and_file(tiny_codec_dirs, tmp_path,
                                                                                  layout, edit, message):
    """A codec config.json field of the wrong type was a TypeError or ZeroDivisionError (exit 2 naming nothing,
    or a traceback), where the Talker's are a ConfigError (exit 1) naming the field: the codec's are too, and
    name the file, on the decode path and on the encode path alike."""
    from higgs_rt.codec import EncodeConfig

    codec = copy_of(tiny_codec_dirs[layout], tmp_path)
    config = json.loads((codec / "config.json").read_text())
    (codec / "config.json").write_text(json.dumps({**config, **edit}))
    want = f"{codec / 'config.json'}: codec config: {message}"
    encode_only = "kernel_size" in edit or any(k in str(edit) for k in ("conv_bias", "layer_norm_eps"))
    for read in (EncodeConfig.from_dir,) if encode_only else (CodecConfig.from_dir, EncodeConfig.from_dir):
        with pytest.raises(ConfigError) as caught:
            read(codec)
        assert str(caught.value).startswith(want), (str(caught.value), want)
    if encode_only:
        assert CodecConfig.from_dir(codec).layout == layout


def test_a_bad_codec_config_is_exit_1_and_one_line_like_a_bad_talker_config(random_model, tmp_path, capsys):
    from higgs_rt.cli import main

    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    config = json.loads((model / "audio_tokenizer" / "config.json").read_text())
    (model / "audio_tokenizer" / "config.json").write_text(json.dumps({**config, "sample_rate": "24000"}))
    assert main(["speak", "Hi.", "--model", str(model), "--out", str(tmp_path / "hi.wav")]) == 1
    assert capsys.readouterr().err == (f"higgs-rt: error: {model / 'audio_tokenizer' / 'config.json'}: codec config: "
                                       'sample_rate must be an integer, got "24000"\n')


@pytest.mark.parametrize("edit", [dict(n_q=7), dict(sample_rate=48000)])
def test_a_codec_whose_codebooks_disagree_with_the_talkers_is_exit_1_naming_both_configs(random_model, tiny_codec_dirs,
                                                                                          tmp_path, capsys, edit):
    """A codec config giving other codebooks than the Talker's (Boson's n_q; in the transformers layout a sample
    rate, which changes the quantizer count derived from the bandwidth) was a bare ValueError: exit 2, no file
    named. It is a ConfigError naming both config.json files: exit 1."""
    from higgs_rt.cli import main

    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    codec = model / "audio_tokenizer"
    if "n_q" in edit:  # a Boson codec beside the Talker
        shutil.rmtree(codec)
        shutil.copytree(tiny_codec_dirs["boson"], codec)
    config = json.loads((codec / "config.json").read_text())
    (codec / "config.json").write_text(json.dumps({**config, **edit}))
    assert main(["speak", "Hi.", "--model", str(model), "--out", str(tmp_path / "hi.wav")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"higgs-rt: error: {codec / 'config.json'}: the codec's ") and err.count("\n") == 1, err
    assert f"codes of the model's {model / 'config.json'}" in err, err


def test_sizes_in_range_whose_product_overflows_are_a_config_error(tiny_codec_dirs, tmp_path):
    """Each field within its bounds, but a weight of hidden_size^2 elements past what torch can index: torch's
    'Storage size calculation overflowed' traceback before; a ConfigError naming the file now, decode and encode."""
    from higgs_rt.codec.load import load_encoder

    codec = copy_of(tiny_codec_dirs["transformers"], tmp_path)
    config = json.loads((codec / "config.json").read_text())
    config["acoustic_model_config"]["hidden_size"] = 2**31 - 1
    (codec / "config.json").write_text(json.dumps(config))
    for load in (load_codec, load_encoder):
        with pytest.raises(ConfigError, match=r"codec config: its sizes make no model torch can build \(") as caught:
            load(codec)
        assert str(caught.value).startswith(str(codec / "config.json")) and "\n" not in str(caught.value)


@pytest.mark.parametrize("layout,edit", [
    ("transformers", dict(downsample_factor=160)),
    ("transformers", dict(semantic_sample_rate=15999)),
    ("boson", dict(sample_rate=24001)),
    ("transformers", dict(strides=[2, 1])),
])
def test_semantic_features_off_the_frame_rate_are_a_config_error(tiny_codec_dirs, tmp_path, layout, edit):
    """HuBERT's features must come at the codec's frame rate: a downsample_factor, semantic or codec sample rate
    that breaks it loaded, then made voice cloning fail with 'acoustic (5) and semantic (1) frame counts differ'
    or a resampler's 'filter bank' ValueError. It is a ConfigError naming the file, on the encode path only."""
    from higgs_rt.codec import EncodeConfig

    codec = copy_of(tiny_codec_dirs[layout], tmp_path)
    config = json.loads((codec / "config.json").read_text())
    (codec / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=r"codec config: semantic features at \d+ / \d+ Hz .* do not come at the "
                                          r"frame rate \d+ / 960 Hz$") as caught:
        EncodeConfig.from_dir(codec)
    assert str(caught.value).startswith(str(codec / "config.json"))


def test_a_semantic_resampling_no_filter_bank_can_do_is_a_config_error(tiny_codec_dirs):
    """On the frame rate, but 24018 -> 24006 Hz (4003:4001) needs a 16M-tap sinc filter bank: refused at load,
    not by the resampler at the first clone."""
    from higgs_rt.codec import EncodeConfig

    config = json.loads((tiny_codec_dirs["transformers"] / "config.json").read_text())
    ratios = [8, 5, 4, 2, 3, 4003]
    config.update(sample_rate=24018, semantic_sample_rate=24006)
    config["acoustic_model_config"].update(upsampling_ratios=ratios, downsampling_ratios=ratios)
    with pytest.raises(ConfigError, match="resampling sample_rate 24018 to semantic_sample_rate 24006 needs a filter "
                                          "bank past 4194304 taps"):
        EncodeConfig.from_dict(config)


@pytest.mark.parametrize("layout", ["transformers", "boson"])
@pytest.mark.parametrize("edit,message", [
    (dict(num_hidden_layers=2**31 - 1), "holds 1 HuBERT layers, the config's semantic_model_config.num_hidden_layers "
                                        "gives 2147483647"),
    (dict(conv_dim=[8] * 7 + [1] * 9993, conv_kernel=[10, 3, 3, 3, 3, 2, 2] + [1] * 9993,
          conv_stride=[5, 2, 2, 2, 2, 2, 2] + [1] * 9993),
     "holds 7 HuBERT conv layers, the config's semantic_model_config.conv_dim gives 10000"),
    (dict(block_dilations=[1] * 10000), "holds 2 residual units a semantic block, the config's block_dilations "
                                        "gives 10000"),
])
def test_hubert_deeper_than_the_checkpoint_is_one_error_before_building(tiny_codec_dirs, tmp_path, layout, edit,
                                                                        message):
    """semantic_model_config.num_hidden_layers=2**31-1 (a size in range) over a 1-layer checkpoint built layers on
    the meta device for ever before naming the first missing tensor (10000 block_dilations: 6 s); the counts are
    compared first."""
    from higgs_rt.codec.load import load_encoder

    codec = copy_of(tiny_codec_dirs[layout], tmp_path)
    config = json.loads((codec / "config.json").read_text())
    if "block_dilations" in edit:
        if layout == "boson":
            pytest.skip("Boson's config.json has no block_dilations: its semantic encoder is fixed")
        config.update(edit)
    else:
        config["semantic_model_config"].update(edit)
    (codec / "config.json").write_text(json.dumps(config))
    with pytest.raises(CodecCheckpointError) as caught:
        load_encoder(codec)
    assert str(caught.value).endswith(message)


def copy_of(src, tmp_path):
    dst = tmp_path / "codec"
    shutil.copytree(src, dst)
    return dst


def test_missing_decode_tensor_is_named(tiny_codec_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = copy_of(tiny_codec_dirs["transformers"], tmp_path)
    tensors = load_file(broken / "model.safetensors")
    del tensors["acoustic_decoder.block.2.res_unit3.conv1.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CodecCheckpointError, match=r"'acoustic_decoder\.block\.2\.res_unit3\.conv1\.weight' is miss"):
        load_codec(broken)


def test_mismatched_config_and_weights_name_key_and_shapes(tiny_codec_dirs, tmp_path):
    mismatched = copy_of(tiny_codec_dirs["boson"], tmp_path)
    config = json.loads((mismatched / "config.json").read_text())
    config["decoder_channels"] = 128
    (mismatched / "config.json").write_text(json.dumps(config))
    with pytest.raises(CodecCheckpointError, match=r"decoder_2\.model\.0\.weight_v.*\(64, 16, 7\).*\(128, 16, 7\)"):
        load_codec(mismatched)


def _edit_codec(directory, layout: str, edit) -> None:
    """Rewrite a codec checkpoint's tensors in place (either layout)."""
    from safetensors.torch import load_file, save_file

    file = directory / ("model.safetensors" if layout == "transformers" else "model.pth")
    tensors = load_file(file) if layout == "transformers" else torch.load(file, weights_only=True)
    edit(tensors)
    save_file(tensors, file) if layout == "transformers" else torch.save(tensors, file)


@pytest.mark.parametrize("layout,key,named", [
    ("transformers", "fc2.bias", "'fc2.bias'"),
    ("transformers", "quantizer.quantizers.3.codebook.embed", "'quantizer.quantizers.3.codebook.embed'"),
    ("boson", "decoder_2.model.0.weight_v", "'decoder_2.model.0.weight_v' / 'decoder_2.model.0.weight_g'"),
])
def test_codec_weights_holding_nan_or_inf_are_refused_naming_file_and_key(tiny_codec_dirs, tmp_path, layout, key,
                                                                          named):
    broken = copy_of(tiny_codec_dirs[layout], tmp_path)
    _edit_codec(broken, layout, lambda t: t[key].view(-1).__setitem__(1, float("inf")))
    file = broken / ("model.safetensors" if layout == "transformers" else "model.pth")
    with pytest.raises(CodecCheckpointError) as caught:
        load_codec(broken)
    assert str(caught.value) == f"{file}: {named} holds NaN or infinite values: the checkpoint is corrupt"


def test_integer_codec_weights_are_refused_naming_file_key_and_dtype(tiny_codec_dirs, tmp_path):
    broken = copy_of(tiny_codec_dirs["transformers"], tmp_path)
    key = "acoustic_decoder.block.0.conv_t1.bias"
    _edit_codec(broken, "transformers", lambda t: t.update({key: t[key].to(torch.int64)}))
    with pytest.raises(CodecCheckpointError) as caught:
        load_codec(broken)
    assert str(caught.value) == (f"{broken / 'model.safetensors'}: '{key}' is stored as int64, where a "
                                 "floating-point tensor is expected")


def test_encode_weights_are_checked_as_well(tiny_codec_dirs, tmp_path):
    from higgs_rt.codec import load_encoder

    broken = copy_of(tiny_codec_dirs["transformers"], tmp_path)
    key = "semantic_model.encoder.layers.0.attention.q_proj.weight"
    _edit_codec(broken, "transformers", lambda t: t[key].fill_(float("nan")))
    load_codec(broken)  # the decode path does not read it
    with pytest.raises(CodecCheckpointError, match=f"'{key}' holds NaN or infinite values"):
        load_encoder(broken)


def test_corrupted_weights_file_is_named(tiny_codec_dirs, tmp_path):
    for layout, name in (("transformers", "model.safetensors"), ("boson", "model.pth")):
        broken = copy_of(tiny_codec_dirs[layout], tmp_path / layout)
        (broken / name).write_bytes((broken / name).read_bytes()[:1000])
        with pytest.raises(CodecCheckpointError, match=f"{name}: cannot read"):
            load_codec(broken)


# ----------------------------------------------------------------------------- where checkpoints come from


@pytest.fixture
def isolated_hub(tmp_path, monkeypatch):
    """An empty HF cache and a network that answers the reachability probe but fails every download:
    hf_hub_download records its calls and fails."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("higgs_rt.hub.hub_unreachable", lambda timeout=None: None)
    calls = []

    def no_network(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        raise OSError("network is unreachable")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_network)
    return SimpleNamespace(cache=tmp_path / "hub", calls=calls)


def test_explicit_path_then_env_vars_in_order(tiny_codec_dirs, tmp_path, monkeypatch):
    tf_dir, boson_dir = tiny_codec_dirs["transformers"], tiny_codec_dirs["boson"]
    monkeypatch.setenv(ENV_VARS[1], str(boson_dir))
    assert resolve_codec_dir() == boson_dir
    monkeypatch.setenv(ENV_VARS[0], str(tf_dir))
    assert resolve_codec_dir() == tf_dir
    assert resolve_codec_dir(boson_dir) == boson_dir
    packaged = tmp_path / "OmniVoice"  # codec in an audio_tokenizer/ subdirectory
    shutil.copytree(tf_dir, packaged / "audio_tokenizer")
    (packaged / "config.json").write_text(json.dumps({"model_type": "omnivoice"}))
    assert resolve_codec_dir(packaged) == packaged / "audio_tokenizer"


def test_the_models_bundled_codec_comes_before_the_env_vars(tiny_codec_dirs, tmp_path, monkeypatch, isolated_hub):
    tf_dir, boson_dir = tiny_codec_dirs["transformers"], tiny_codec_dirs["boson"]
    model = tmp_path / "model"
    shutil.copytree(tf_dir, model / "audio_tokenizer")
    monkeypatch.setenv(ENV_VARS[0], str(boson_dir))
    assert resolve_codec_dir(None, model) == model / "audio_tokenizer"  # the README's order
    assert resolve_codec_dir(boson_dir, model) == boson_dir  # --codec first
    assert resolve_codec_dir(None, tmp_path) == boson_dir  # a model without one: the variable
    monkeypatch.delenv(ENV_VARS[0])
    (model / "audio_tokenizer" / "model.safetensors").unlink()  # bundled but broken: said, not passed over
    with pytest.raises(CodecNotFoundError, match="the model's codec=.*audio_tokenizer: transformers config.json "
                                                 "but no model.safetensors"):
        resolve_codec_dir(None, model)
    assert not isolated_hub.calls


def test_explicit_location_without_codec_is_an_error(tmp_path, monkeypatch, isolated_hub):
    with pytest.raises(CodecNotFoundError, match="path=.*nowhere: not a directory"):
        resolve_codec_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(ENV_VARS[0], str(tmp_path / "empty"))
    with pytest.raises(CodecNotFoundError, match=r"\$HIGGS_AUDIO_TOKENIZER_PATH=.*empty: no config.json"):
        load_codec()
    assert not isolated_hub.calls


def test_hf_cache_is_used_before_download(tiny_codec_dirs, isolated_hub):
    snapshot = isolated_hub.cache / "models--bosonai--higgs-audio-v2-tokenizer" / "snapshots" / "abc123"
    shutil.copytree(tiny_codec_dirs["boson"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    assert resolve_codec_dir() == snapshot
    assert not isolated_hub.calls


def test_download_fetches_only_config_and_model_pth(tiny_codec_dirs, monkeypatch, isolated_hub):
    def fake_download(repo_id, filename, **kwargs):
        isolated_hub.calls.append((repo_id, filename))
        return str(tiny_codec_dirs["boson"] / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    assert resolve_codec_dir() == tiny_codec_dirs["boson"]
    assert isolated_hub.calls == [(REPO_ID, "config.json"), (REPO_ID, "model.pth")]


def test_nothing_found_lists_every_place(isolated_hub, monkeypatch):
    with pytest.raises(CodecNotFoundError) as failed:
        resolve_codec_dir()
    message = str(failed.value)
    for place in ("path argument", *ENV_VARS, str(isolated_hub.cache), REPO_ID, "network is unreachable"):
        assert place in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    isolated_hub.calls.clear()
    with pytest.raises(CodecNotFoundError, match="skipped, HF_HUB_OFFLINE is set"):
        resolve_codec_dir()
    assert not isolated_hub.calls


def test_unreachable_hub_fails_at_once_without_trying_the_download(isolated_hub, tmp_path, monkeypatch):
    """Nothing local and no Hub: one probe, no download (whose retries took 38 s), every place named."""
    import higgs_rt.hub

    probes = []
    monkeypatch.setattr(higgs_rt.hub, "hub_unreachable",
                        lambda timeout=None: probes.append(1) or "https://huggingface.co is unreachable (ConnectError)")
    with pytest.raises(CodecNotFoundError) as failed:
        resolve_codec_dir(None, tmp_path)
    assert (probes, isolated_hub.calls) == ([1], [])
    message = str(failed.value)
    for place in (f"the model's codec {tmp_path / 'audio_tokenizer'}: none", *ENV_VARS, str(isolated_hub.cache),
                  f"download of {REPO_ID}: skipped, https://huggingface.co is unreachable (ConnectError)"):
        assert place in message


@pytest.mark.parametrize("env,flags", [({}, "False False"), ({"HIGGS_RT_CODEC_TF32": "1"}, "True True")])
def test_codec_calls_run_in_ieee_fp32_unless_the_tf32_measurement_asks(env, flags):
    code = ("import torch; from higgs_rt.codec.layers import ieee_fp32\n"
            "torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True\n"
            "with ieee_fp32(): print(torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)\n"
            "print(torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.splitlines()
    assert out == [flags, "True True"]  # and the process's own setting is back afterwards
