"""The Higgs-Audio v2 codec: decode (codes -> 24 kHz waveform, offline and streaming) and, for voice cloning,
encode (waveform -> codes).

- `config`: `CodecConfig` (decode) and `EncodeConfig` (encode), read from either checkpoint layout's config.json;
- `layers`: the DAC acoustic decoder and encoder;
- `model`: `Code2Wav` (decode, Talker post-processing) and `delay_pattern` (aligned codes -> delayed frames);
- `semantic`: HuBERT and the semantic encoder (the encode path's semantic branch);
- `encode`: `Wav2Code` (waveform -> codes);
- `load`: where checkpoints are found and how both layouts are read (`load_codec`, `load_encoder`, `codec_id`);
- `stateful`: Code2Wav evaluated as a stream (every convolution with its own left state, batched lanes);
- `stream`: `StreamingCodec` (per-slot lanes), `StreamingDecoder` (one utterance) and the receptive field.
"""

from .config import CodecConfig, EncodeConfig
from .encode import Wav2Code
from .load import CodecCheckpointError, CodecNotFoundError, codec_id, load_codec, load_encoder, resolve_codec_dir
from .model import Code2Wav, delay_pattern
from .stream import StreamingCodec, StreamingDecoder, receptive_field

__all__ = [
    "CodecConfig",
    "Code2Wav",
    "CodecCheckpointError",
    "CodecNotFoundError",
    "EncodeConfig",
    "StreamingCodec",
    "StreamingDecoder",
    "Wav2Code",
    "codec_id",
    "delay_pattern",
    "load_codec",
    "load_encoder",
    "receptive_field",
    "resolve_codec_dir",
]
