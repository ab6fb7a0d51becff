"""higgs-rt's kernels as torch operators (`torch.ops.higgs_rt.*`, registered in C++ by libhiggs_rt_ops.so),
each with input checks (a ValueError naming the op and the argument) and a pure-torch reference (`*_ref`, the
test oracle, also what runs on devices and dtypes a kernel does not take, and inside `references()`).

- codes:     delay_revert, rvq_lookup (C++ and CUDA)
- snake:     snake, the codec's activation, masked (C++ and CUDA)
- codec_stream: codec_window, tap_sum, codec_conv (CUDA: the streaming codec's layers)
- dualffn:   dualffn_route, dualffn_unroute (C++ and CUDA)
- rowwise:   rms_norm, add_rms_norm, rope_qkv, silu_mul (CUDA: the prompt forward's steps around its matmuls)
- gemv:      gemv, gemv_residual, norm_gemv_silu, norm_gemv_logits, norm_qkv_rope (CUDA: the decode step)
- attention: decode_attention (CUDA)
- sampler:   sample_frame (CUDA; reference: higgs_rt.sampling.FrameSampler)
"""

from .attention import DECODE_ATTENTION_HEAD_DIMS, attention_counters, decode_attention, decode_attention_ref
from .codec_stream import (codec_conv, codec_conv_ref, codec_conv_supported, codec_window, codec_window_ref, tap_sum,
                           tap_sum_ref)
from .codes import delay_revert, delay_revert_ref, rvq_lookup, rvq_lookup_ref
from .dualffn import dualffn_route, dualffn_route_ref, dualffn_unroute, dualffn_unroute_ref
from .gemv import (GEMV_MAX_BATCH, gemv, gemv_ref, gemv_residual, gemv_residual_ref, norm_gemv_logits,
                   norm_gemv_logits_ref, norm_gemv_silu, norm_gemv_silu_ref, norm_qkv_rope, norm_qkv_rope_ref, rotate)
from .library import CUDA_ARCHS, HAS_CUDA_KERNELS, HAS_EXTENSION, references, using_references
from .rowwise import (add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref, rope, rope_qkv, rope_qkv_ref, silu_mul,
                      silu_mul_ref)
from .sampler import sample_frame, sample_frame_supported
from .snake import snake, snake_ref

__all__ = [
    "CUDA_ARCHS", "DECODE_ATTENTION_HEAD_DIMS", "GEMV_MAX_BATCH", "HAS_CUDA_KERNELS", "HAS_EXTENSION",
    "add_rms_norm", "add_rms_norm_ref", "attention_counters", "codec_conv", "codec_conv_ref", "codec_conv_supported",
    "codec_window", "codec_window_ref", "decode_attention",
    "decode_attention_ref",
    "delay_revert", "delay_revert_ref", "dualffn_route", "dualffn_route_ref", "dualffn_unroute", "dualffn_unroute_ref",
    "gemv", "gemv_ref", "gemv_residual", "gemv_residual_ref", "norm_gemv_logits", "norm_gemv_logits_ref", "norm_gemv_silu",
    "norm_gemv_silu_ref", "norm_qkv_rope", "norm_qkv_rope_ref", "references", "rms_norm", "rms_norm_ref", "rope",
    "rope_qkv", "rope_qkv_ref", "rotate", "rvq_lookup", "rvq_lookup_ref", "sample_frame", "sample_frame_supported",
    "silu_mul", "silu_mul_ref", "snake", "snake_ref", "tap_sum", "tap_sum_ref", "using_references",
]
