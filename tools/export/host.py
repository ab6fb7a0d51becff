"""The weights file for hosts without Python (examples/host): `weights.pt`, written beside the packages.

    {"format": 1,
     "tensors": {name: tensor},   what the packages bind: the runtime's loaded Talker and codec tensors under the
                                  names `higgs_rt.compiled` binds (`talker.*`, `codec.*`), fused as loaded, on the CPU
     "host": {...}}               what a host needs to drive the packages, see `host_facts`

Why torch.save: libtorch reads it with `torch::jit::pickle_load` and nothing else, names, dtypes and shapes
included, and the facts (ints, strings, lists, tensors) travel in the same file, so the C++ host needs no JSON or
safetensors library. The cost: the host reads the file whole before unpickling (twice the weights at peak;
the 3B model's bf16 weights are 7.2 GB) and the file is one more copy of the weights on disk (`--no-host-weights`
skips it). Safetensors would map instead of read, but libtorch has no reader for it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from higgs_rt.codec import Code2Wav
from higgs_rt.compiled import named_tensors
from higgs_rt.sampling import FrameSampler, SamplingParams
from higgs_rt.talker import Talker

WEIGHTS = "weights.pt"
FORMAT = 1


def slot_reset(talker: Talker) -> dict[str, torch.Tensor]:
    """A slot's sampler state as `FrameSampler.reset` leaves it for the default SamplingParams and seed 0: a host
    writes these into the slot and then its seed into `sampler.seeds` (the reset logic stays in one place)."""
    sampler = FrameSampler(1, talker.cfg.num_codebooks, talker.cfg.num_codes, "cpu")
    sampler.reset(0, SamplingParams(seed=0))
    return {f"sampler.{name}": getattr(sampler, name)[0].clone() for name in FrameSampler.STATE}


def host_facts(talker: Talker, codec: Code2Wav, manifest: dict) -> dict:
    """Device, context and batch sizes; the Talker's vocabulary size and audio token ids (a text-only host refuses
    them), codebooks, codes and stream BOS/EOS ids; the codec's sample rate; the batch-1 step's state spec as the
    manifest records it (the step's inputs after the frames, in order) and `slot_reset`."""
    cfg = talker.cfg
    step_b1 = manifest["artifacts"].get("step_b1.pt2")
    return {"device": manifest["device"], "context": manifest["context"], "batch_sizes": manifest["batch_sizes"],
            "vocab_size": cfg.vocab_size, "audio_token_ids": list(cfg.audio_token_ids),
            "num_codebooks": cfg.num_codebooks, "num_codes": cfg.num_codes, "stream_bos_id": cfg.stream_bos_id,
            "stream_eos_id": cfg.stream_eos_id, "sample_rate": codec.sample_rate,
            "state": step_b1["state"] if step_b1 else [], "slot_reset": slot_reset(talker)}


def write_host_weights(out: Path, talker: Talker, codec: Code2Wav, manifest: dict) -> dict:
    """Write out/weights.pt; returns its manifest entry."""
    tensors = {name: t.detach().cpu().contiguous() for module, prefix in ((talker, "talker"), (codec, "codec"))
               for name, t in named_tensors(module, prefix).items()}
    path = out / WEIGHTS
    torch.save({"format": FORMAT, "tensors": tensors, "host": host_facts(talker, codec, manifest)}, path)
    return {"file": WEIGHTS, "bytes": path.stat().st_size, "tensors": len(tensors)}
