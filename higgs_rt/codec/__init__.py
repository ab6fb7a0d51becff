"""The Higgs-Audio v2 codec's decode path: codes -> 24 kHz waveform, offline and streaming.

- `config`: `CodecConfig`, read from either checkpoint layout's config.json;
- `layers`: the DAC acoustic decoder;
- `model`: `Code2Wav` (decode, Talker post-processing);
- `load`: where checkpoints are found and how both layouts are read (`load_codec`);
- `stream`: `StreamingDecoder` and the decoder's receptive field.
"""

from .config import CodecConfig
from .load import CodecCheckpointError, CodecNotFoundError, load_codec, resolve_codec_dir
from .model import Code2Wav
from .stream import StreamingDecoder, receptive_field

__all__ = [
    "CodecConfig",
    "Code2Wav",
    "CodecCheckpointError",
    "CodecNotFoundError",
    "StreamingDecoder",
    "load_codec",
    "receptive_field",
    "resolve_codec_dir",
]
