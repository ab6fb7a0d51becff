"""The three programs the runtime swaps in, as `nn.Module`s torch.export can trace, and how each is traced (to
core ATen: functional, with the step's state writes as input mutations).

Each module holds the runtime's own module (`talker`, `codec`) as a child, so the constants of the compiled
package are named `talker.*` / `codec.*`, the names `higgs_rt.compiled` binds the loaded tensors to.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from higgs_rt.codec import Code2Wav
from higgs_rt.compiled import MIN_CODEC_FRAMES, MIN_PROMPT, STATE_OWNERS, state_spec, step_state
from higgs_rt.generate import Decoder
from higgs_rt.talker import Talker
from higgs_rt.torch_compat import size_oblivious_tracing


class PrefillProgram(nn.Module):
    """(ids [T], audio_frames [N, Q]) -> (logits [Q, V], keys and values [L, Hkv, T, D]): `Talker.prompt_forward`
    on its branch-free path, the cache writes left to the runner."""

    def __init__(self, talker: Talker):
        super().__init__()
        self.talker = talker

    def forward(self, ids: Tensor, audio_frames: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        keys, values = [], []

        def store(i: int, k: Tensor, v: Tensor) -> None:
            keys.append(k)
            values.append(v)

        logits = self.talker.prompt_forward(ids, audio_frames, store, always_route=True)
        return logits, torch.stack(keys), torch.stack(values)


class StepProgram(nn.Module):
    """(frames [B, Q], *state) -> next frames [B, Q]: `Decoder.step` with the decoder's state tensors replaced by
    the inputs (in `step_state` order) while it is traced, so its in-place updates become input mutations."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.talker = decoder.talker
        self.decoder = decoder
        self.names = list(step_state(decoder))

    def forward(self, frames: Tensor, *state: Tensor) -> Tensor:
        saved = step_state(self.decoder)
        _assign(self.decoder, dict(zip(self.names, state)))
        try:
            return self.decoder.step(frames)
        finally:
            _assign(self.decoder, saved)


class CodecProgram(nn.Module):
    """codes [1, T, Q] -> waveform [1, T * hop]: `Code2Wav.decode`."""

    def __init__(self, codec: Code2Wav):
        super().__init__()
        self.codec = codec

    def forward(self, codes: Tensor) -> Tensor:
        return type(self.codec).decode(self.codec, codes)


def _assign(decoder: Decoder, tensors: dict[str, Tensor]) -> None:
    for name, tensor in tensors.items():
        owner, attr = name.split(".")
        setattr(getattr(decoder, owner), attr, tensor)


def export_prefill(talker: Talker, context: int) -> ExportedProgram:
    """Dynamic prompt length (2 to context) and audio frames (0 to context). Sizes 0 and 1 are only traceable
    size-obliviously (`backed_size_oblivious`); the example is away from them, and the tests check 0 frames."""
    t, n = min(16, context), min(4, context - 1)
    ids = torch.zeros(t, dtype=torch.long, device=talker.device)
    ids[1:n + 1] = talker.cfg.audio_token_ids[0]
    frames = torch.zeros((n, talker.cfg.num_codebooks), dtype=torch.long, device=talker.device)
    dims = ({0: Dim("prompt", min=MIN_PROMPT, max=context)}, {0: Dim("audio_frames", min=0, max=context)})
    with size_oblivious_tracing():
        return torch.export.export(PrefillProgram(talker), (ids, frames), dynamic_shapes=dims,
                                   strict=False).run_decompositions()


def export_step(decoder: Decoder) -> ExportedProgram:
    """Static shapes: one program per batch size and context. The state is what the cache and the sampler declare
    (`STATE`); a step that writes a tensor they do not declare written fails here, not in a runtime's state."""
    cfg = decoder.talker.cfg
    frames = torch.full((decoder.cache.batch, cfg.num_codebooks), cfg.stream_bos_id, dtype=torch.long,
                        device=decoder.talker.device)
    state = list(step_state(decoder).values())  # traced as fakes: the export's own decoder is never stepped, so
    # no copy (a clone of the batch-64 cache was 15 GB more, and ran an H100 out of memory beside the other packages)
    undeclared = {f"{owner}.{name}": (obj, name, t.clone()) for owner in STATE_OWNERS
                  for obj in (getattr(decoder, owner),) for name, t in vars(obj).items()
                  if isinstance(t, Tensor) and name not in type(obj).STATE}
    program = torch.export.export(StepProgram(decoder), (frames, *state), strict=False)
    writes = {name for name, (obj, attr, before) in undeclared.items() if not torch.equal(getattr(obj, attr), before)}
    if not writes:  # (torch refuses to functionalise writes to undeclared tensors: they would be constants)
        program = program.run_decompositions()
        inputs = dict(zip(program.graph_signature.user_inputs, ["frames", *step_state(decoder)]))
        writes = {inputs[name] for name in program.graph_signature.user_inputs_to_mutate.values()}
    allowed = {name for name, _, _, written in state_spec(decoder) if written}
    if writes - allowed:
        raise ValueError(f"the decode step writes {', '.join(sorted(writes - allowed))}, which the owner's STATE "
                         "does not declare written (higgs_rt.talker.KVCache, higgs_rt.sampling.FrameSampler)")
    return program


def export_codec(codec: Code2Wav) -> ExportedProgram:
    """One row (what streaming decodes), dynamic frames from 2. Not size-oblivious: traced that way from a
    one-row example with a dynamic batch, every row after the first came out wrong (torch 2.13, CPU)."""
    codes = torch.zeros((1, 30, codec.num_quantizers), dtype=torch.long, device=codec.table.device)
    dims = ({1: Dim("frames", min=MIN_CODEC_FRAMES)},)
    return torch.export.export(CodecProgram(codec), (codes,), dynamic_shapes=dims, strict=False).run_decompositions()
