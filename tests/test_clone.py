"""Voice cloning against transformers on tiny random checkpoints: codec encode (`Wav2Code` vs
`HiggsAudioV2TokenizerModel.encode`) on espeak-ng speech, both layouts, and the clone prompt (frames, ids and
Talker prefill logits vs `HiggsAudioV2Processor` + `HiggsAudioV2ForConditionalGeneration`)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from higgs_rt.audio_in import load_reference
from higgs_rt.codec import EncodeConfig, delay_pattern, load_encoder
from higgs_rt.config import ConfigError
from higgs_rt.engine import Voice
from higgs_rt.fixtures.codec import build_oracle, make_codec
from higgs_rt.prompt import PromptBuilder
from higgs_rt.resample import install_torchaudio_standin
from higgs_rt.talker import Talker

from conftest import REFERENCE_TEXT

install_torchaudio_standin()
from transformers import AutoTokenizer, DacFeatureExtractor  # noqa: E402
from transformers.models.higgs_audio_v2.processing_higgs_audio_v2 import HiggsAudioV2Processor  # noqa: E402

K, Q, HOP = 16, 8, 960
TEXT = "Now say this in the same voice."


@pytest.fixture(scope="module")
def codec_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("clone-codec")
    return {layout: make_codec(root / layout, "tiny", layout=layout, seed=3) for layout in ("transformers", "boson")}


@pytest.fixture(scope="module")
def oracle(codec_dirs):
    return build_oracle(codec_dirs["transformers"])


@pytest.fixture(scope="module")
def encoder(codec_dirs):
    return load_encoder(codec_dirs["transformers"])


def oracle_codes(oracle, wav: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return oracle.encode(wav.reshape(-1, 1, wav.shape[-1])).audio_codes.transpose(1, 2).squeeze(0)


def noise(samples: int, seed: int) -> torch.Tensor:
    return 0.1 * torch.randn(samples, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- encode parity


def test_fixture_is_random_where_encode_reads(encoder, oracle):
    """A fresh transformers codec has zero codebooks and encodes everything to zeros: every tensor encode reads
    must be random, and different inputs must give different codes in every codebook."""
    for name, tensor in encoder.state_dict().items():
        assert tensor.numel() > 1 and tensor.float().std() > 1e-3, f"{name} is constant"
    a, b = oracle_codes(oracle, noise(2 * 24000, 1)), oracle_codes(oracle, noise(2 * 24000, 2))
    assert a.shape == (50, Q)
    assert (a != b).any(0).all() and (a != b).float().mean() > 0.5
    assert all(len(a[:, k].unique()) >= 5 for k in range(Q))


@pytest.mark.parametrize("variant", ["22k", "8k", "48k", "flac", "stereo"])
def test_codes_equal_oracle_on_speech(encoder, oracle, speech, variant):
    ref = load_reference(speech[variant])
    got = encoder.encode(ref.samples)
    want = oracle_codes(oracle, ref.samples)
    assert got.shape == want.shape == (math.ceil(len(ref.samples) / HOP), Q)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_codes_equal_oracle_for_both_length_rules_and_batches(encoder, oracle):
    """A length the DAC encoder frames like the semantic branch (a multiple of the hop) is encoded as is, any other
    padded by hop / 2 on each side first; both must match, and a batch must equal its rows."""
    lengths = (24 * HOP, 24 * HOP + 480, 13 * HOP + 1, 31 * HOP - 1)
    padded = []
    for n in lengths:
        wav = noise(n, n)
        got = encoder.encode(wav)
        assert torch.equal(got, oracle_codes(oracle, wav)), n
        padded.append(encoder.acoustic_encoder.output_length(n) != got.shape[0])
    assert not all(padded) and any(padded)
    batch = torch.stack([noise(20 * HOP, 5), noise(20 * HOP, 6)])
    got = encoder.encode(batch)
    assert got.shape == (2, 20, Q)
    assert torch.equal(got[1], encoder.encode(batch[1])) and torch.equal(got[0], oracle_codes(oracle, batch[0]))


def test_boson_layout_encodes_like_transformers(codec_dirs, encoder, speech):
    boson = load_encoder(codec_dirs["boson"])
    assert boson.config.codec.layout == "boson"
    wav = load_reference(speech["22k"]).samples
    assert torch.equal(boson.encode(wav), encoder.encode(wav))


def test_encode_config_matches_transformers(codec_dirs, oracle):
    cfg = EncodeConfig.from_dir(codec_dirs["transformers"])
    assert cfg.semantic_downsample == oracle.config.semantic_downsample_factor == 2
    assert cfg.hubert.num_layers == oracle.config.semantic_model_config.num_hidden_layers
    assert dataclasses.replace(EncodeConfig.from_dir(codec_dirs["boson"]), codec=cfg.codec) == cfg
    real_boson = {"D": 256, "codebook_dim": 64, "ratios": [8, 5, 4, 2, 3], "sample_rate": 24000, "bins": 1024,
                  "n_q": 8, "semantic_techer": "hubert_base_general"}
    full = EncodeConfig.from_dict(real_boson)
    assert (full.encoder_channels, full.hubert.hidden_size, full.hubert.num_layers, full.semantic_downsample) == \
        (64, 768, 12, 2)
    with pytest.raises(ConfigError, match="do_stable_layer_norm=true is not supported"):
        EncodeConfig.from_dict({**real_boson, "semantic_model_config": {"do_stable_layer_norm": True}})


def test_encode_input_checks(encoder):
    with pytest.raises(ValueError, match="float"):
        encoder.encode(torch.zeros(24000, dtype=torch.int16))
    with pytest.raises(ValueError, match="too short"):
        encoder.encode(torch.zeros(500))
    with pytest.raises(ValueError, match=r"\[n\] or \[B, n\]"):
        encoder.encode(torch.zeros(1, 1, 24000))


# ----------------------------------------------------------------------------- the clone prompt


def test_delay_pattern_matches_processor():
    stub = SimpleNamespace(audio_stream_bos_id=K, audio_stream_eos_id=K + 1)
    for frames in (0, 1, 5, 30):
        codes = torch.randint(0, K, (frames, Q), generator=torch.Generator().manual_seed(frames))
        marked = torch.cat([torch.full((Q, 1), K), codes.T, torch.full((Q, 1), K + 1)], 1)
        want = HiggsAudioV2Processor.build_delay_pattern(stub, marked[None])[0].T
        assert torch.equal(delay_pattern(codes, K, K + 1), want)
        assert delay_pattern(codes, K, K + 1).shape == (frames + Q + 1, Q)


def clone_chat(ref_text: str, text: str) -> str:
    """The voice-clone prompt as transformers is given it: one <|AUDIO_OUT|> placeholder for the reference."""
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    return ("<|begin_of_text|>" + header.format("system") + "Generate audio following instruction.<|eot_id|>"
            + header.format("user") + ref_text + "<|eot_id|>" + header.format("assistant")
            + "<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|><|eot_id|>"
            + header.format("user") + text + "<|eot_id|>" + header.format("assistant") + "<|audio_out_bos|>")


@torch.no_grad()
def test_clone_prompt_logits_match_transformers(talker_dirs, oracle, encoder, speech):
    hf_dir, _, talker_oracle = talker_dirs["tiny"]
    talker = Talker.from_pretrained(hf_dir)
    feature_extractor = DacFeatureExtractor(feature_size=1, hop_length=HOP, sampling_rate=24000)
    processor = HiggsAudioV2Processor(feature_extractor, AutoTokenizer.from_pretrained(hf_dir), oracle,
                                      audio_stream_bos_id=K, audio_stream_eos_id=K + 1)
    ref = load_reference(speech["48k"])
    inputs = processor(text=[clone_chat(REFERENCE_TEXT, TEXT)], audio=[ref.samples.numpy()], return_tensors="pt")

    voice = Voice(REFERENCE_TEXT, delay_pattern(encoder.encode(ref.samples), K, K + 1))
    frames = voice.frames.shape[0]
    assert frames == math.ceil(len(ref.samples) / HOP) + Q + 1
    assert torch.equal(inputs["audio_input_ids"][0], voice.frames)

    prompt = PromptBuilder(hf_dir, talker.cfg.audio_out_token_id).clone(TEXT, voice.text, voice.frames)
    audio_positions = (prompt.ids == talker.cfg.audio_out_token_id).nonzero().flatten()
    assert len(audio_positions) == frames
    expected_ids = prompt.ids.clone()
    expected_ids[audio_positions[-(Q - 1):]] = talker_oracle.config.audio_delay_token_id  # transformers' spelling
    assert torch.equal(inputs["input_ids"][0], expected_ids)

    want = talker_oracle(**inputs).logits[0, -1]
    got = talker.prefill(talker.new_cache(1, 256), 0, prompt.ids, voice.frames)
    diff = (got - want.view_as(got)).abs().max().item()
    print(f"clone prompt: {len(prompt)} tokens, {frames} reference frames, prefill logits max diff {diff:.2e}")
    assert diff <= 1e-5
