"""Export tools: a Higgs-Audio v2 checkpoint -> AOTInductor packages the runtime loads without compiling.

    higgs-rt export --model DIR [--out DIR] [--compute cpu|cuda] [--dtype bf16] [--batch 1 8] [--context 4096]
                    [--kernels higgs-rt|torch] [--cxx g++] [--no-host-weights] [--jobs N]
    python -m tools.export ...     (the same)

What is exported (see `higgs_rt.compiled` for how it is loaded, checked and bound): the Talker's prompt forward
(dynamic prompt length and audio frames), `Decoder.step` per batch size (forward, sampling and the delay-pattern
state machine, static shapes) and Code2Wav's decode of one streaming window (dynamic frames). The loaders have
already fused q/k/v and gate/up, folded the codec's RVQ tables and weight norm: the programs trace the runtime's
own modules, so there is one implementation, eager and exported alike. Beside them: weights.pt, the bound
weights and the facts a host without Python needs (`host.py`; examples/host is such a host, in C++).

Why torch.export + AOTInductor: it is PyTorch's supported ahead-of-time path. torch.export traces a whole,
sound graph (no graph breaks, explicit dynamic dims, guards checked at export), and AOTInductor compiles it with
Inductor's kernels into a package (a shared library plus its kernels) that loads without compiling (0.07 s for
the tiny model's three packages on the CPU), where torch.compile recompiles in every process (56 s of the 3B
model's cold start on the H200, minutes under max-autotune). higgs-rt's kernels are torch operators
registered in C++ (libhiggs_rt_ops.so): they export through their fake kernels, and a package calls them through
the dispatcher from C++ (AOTInductor's proxy executor), so a process that loaded the library runs the packages
without Python. The private torch APIs this needs are in `higgs_rt.torch_compat`, version-gated. TorchScript
is deprecated (maintenance only; PyTorch points to torch.export), scripting would mean rewriting the model into
its Python subset (closures, dataclasses), and it has no Inductor: its fusers went with it.

Measured on torch 2.13 CPU, and chosen:
- weights as user-managed constants: packages are compiled without their weights
  (`package_constants_in_so=False`) and loading passes the runtime's loaded tensors with
  `load_constants(user_managed=True)` (no copy, no 11 GB per artifact; the tiny model's packages are 2 MB).
  Lifting the weights to inputs also works but puts ~250 tensors through every call.
- state as mutated inputs: the step takes the state the KV cache and the sampler declare (`STATE`) as inputs
  and updates them in place (export records the mutations when traced under no_grad; traced inside
  Decoder.step's own no_grad they are silently dropped). Exact codes against the eager step. A cache write into
  a view (`cache.k[i][rows, :, pos]`) came out as a copy of the layer and of the whole cache per call; into the
  whole cache it is in place, and `buffers.py` checks every step package for such copies. The prefill instead
  returns its keys and values ([L, Hkv, T, D], one copy into the slot), which keeps it independent of slot and
  batch.
"""

from .build import export_artifacts
from .probe import ExportProbeError
from .toolchain import ToolchainError

__all__ = ["ExportProbeError", "ToolchainError", "export_artifacts"]
