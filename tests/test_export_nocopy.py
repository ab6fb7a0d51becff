"""No copy of the KV cache inside an exported decode step: the generated wrapper code of the step package
allocates nothing as large as one layer of the cache and clones nothing (`tools.export.buffers`).

Packages are generated as C++ sources only (`aot_inductor.package_cpp_only`: Inductor's whole lowering and code
generation, without compiling), so this runs in seconds; the full export in test_export_host.py checks the
compiled package's record. The fused CUDA step (higgs-rt's C++ ops, whose schemas declare the cache writes) is
traced here on the CPU with the ops' kernels switched on: only its fake kernels run, and the code Inductor
generates around the ops is what decides whether the cache is copied.

On CUDA, AOTInductor also guards every input with a clone that runs only if the input is misaligned at run time
(16 of them in the step package: the frames and the 15 state tensors). A CPU package has no such guard, so the
guards are put in here as torch's CUDA wrapper writes them (`CppWrapperGpu.codegen_inputs`); they are not copies.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import higgs_rt.ops
from higgs_rt.cli import main
from higgs_rt.compiled import state_spec
from higgs_rt.generate import Decoder
from higgs_rt.talker import Talker
from higgs_rt.torch_compat import aoti_compile_and_package
from tools.export.buffers import alignment_guards, allocations, cache_copies, wrapper_source
from tools.export.build import custom_ops, package_configs
from tools.export.programs import export_step

CONTEXT = 256
ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def generate_code(program, path) -> None:
    configs = {**package_configs(CPU), "aot_inductor.package_cpp_only": True}
    aoti_compile_and_package(program, path, configs)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """The "small" random Talker: head size 128, the shape the fused CUDA kernels take."""
    out = tmp_path_factory.mktemp("nocopy") / "small"
    assert main(["make-random-checkpoint", str(out), "--size", "small", "--seed", "8"]) == 0
    return out


def export_fused_step(model_dir, batch: int):
    """(decoder, exported program) of the fused CUDA step, traced on the CPU with the ops' kernels switched on."""
    talker = Talker.from_pretrained(model_dir, dtype=torch.bfloat16, max_positions=CONTEXT)
    decoder = Decoder(talker, batch=batch, context=CONTEXT)
    on = lambda *args: True  # noqa: E731
    with mock.patch.object(Talker, "decode_kernels", True), \
            mock.patch.object(sys.modules["higgs_rt.ops.gemv"], "_kernel", on), \
            mock.patch.object(sys.modules["higgs_rt.ops.attention"], "cuda_kernel", on), \
            mock.patch.object(higgs_rt.ops, "sample_frame_supported", on), torch.no_grad():
        return decoder, export_step(decoder)


@pytest.fixture(scope="module")
def fused_step(small_model, tmp_path_factory):
    """batch -> (decoder, exported program, code-only package) of the fused CUDA step, built once per batch."""
    built = {}

    def build(batch: int):
        if batch not in built:
            decoder, program = export_fused_step(small_model, batch)
            package = tmp_path_factory.mktemp(f"fused-b{batch}") / f"step_b{batch}.pt2"
            generate_code(program, package)
            built[batch] = decoder, program, package
        return built[batch]

    return build


def input_names(source: str) -> list[str]:
    """The wrapper's names of the package's inputs, in input order (frames, then the state)."""
    found = dict((int(i), name) for name, i in re.findall(r"auto (\w+) = std::move\(inputs\[(\d+)\]\);", source))
    return [found[i] for i in range(len(found))]


def passed_whole_to_an_op(source: str, name: str) -> bool:
    """The input itself (not a buffer copied from it) is an argument of one of the package's custom-op calls."""
    calls = re.findall(r"aoti_torch_proxy_executor_call_function\(.*?\{(.*)\}\.data\(\)\)\);", source)
    return any(name in (arg.strip() for arg in call.split(",")) for call in calls)


def written_by_generated_code(source: str, name: str) -> bool:
    """A kernel Inductor generated writes the input (a non-const data pointer of it): a copy back into it."""
    return re.search(rf"\((?!const )[\w:]+\*\)\({name}\.data_ptr\(\)\)", source) is not None


@pytest.mark.parametrize("batch", [1, 3])
def test_the_torch_step_writes_the_cache_in_place(random_model, tmp_path, batch):
    """What export traces on the CPU (and with --kernels torch): Talker.step's index_put into the cache."""
    talker = Talker.from_pretrained(random_model, max_positions=CONTEXT)
    decoder = Decoder(talker, batch=batch, context=CONTEXT)
    with torch.no_grad():
        generate_code(export_step(decoder), tmp_path / "step.pt2")
    layer = decoder.cache.k[0].numel()
    assert allocations(wrapper_source(tmp_path / "step.pt2"))  # the scan sees the step's buffers
    assert cache_copies(tmp_path / "step.pt2", layer) == []


@pytest.mark.parametrize("batch", [1, 2])
def test_the_fused_step_passes_the_cache_to_its_kernels_without_a_copy(fused_step, batch):
    decoder, program, package = fused_step(batch)
    called = {n.target.name() for n in program.graph.nodes if getattr(n.target, "namespace", None) == "higgs_rt"}
    assert {"higgs_rt::norm_gemv_silu", "higgs_rt::gemv_residual", "higgs_rt::norm_gemv_logits"} <= called
    functionalized = [n for n in program.graph.nodes if "auto_functionalized" in str(n.target)]
    assert {n.args[0].name() for n in functionalized} == {
        "higgs_rt::norm_qkv_rope", "higgs_rt::decode_attention", "higgs_rt::sample_frame"}
    # the manifest's list counts the functionalized (in-place) kernels too
    assert called | {"higgs_rt::norm_qkv_rope", "higgs_rt::decode_attention", "higgs_rt::sample_frame"} == set(
        custom_ops(program))
    assert cache_copies(package, decoder.cache.k[0].numel()) == []


@pytest.mark.parametrize("batch", [1, 2])
def test_the_fused_ops_write_the_decoders_own_state(fused_step, batch):
    """Every state tensor the step writes (the cache by norm_qkv_rope; decode_attention's counters; the lengths,
    frame, eos_start, done and history by sample_frame) goes to its op as itself, and no generated kernel writes
    it: no copy in and back out of any state, however small."""
    decoder, _, package = fused_step(batch)
    source = wrapper_source(package)
    names = dict(zip([name for name, *_ in state_spec(decoder)], input_names(source)[1:]))
    written = [name for name, _, _, writes in state_spec(decoder) if writes]
    assert len(names) == 15 and len(written) == 8
    assert [s for s in written if not passed_whole_to_an_op(source, names[s])] == []
    assert [s for s in names if written_by_generated_code(source, names[s])] == []


def gpu_alignment_guards(names: list[str]) -> str:
    """What AOTInductor's CUDA wrapper writes for these inputs (all compiled as 16-byte aligned), rendered by torch's
    own `CppWrapperGpu.codegen_inputs` (the rest of its input code left out)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.codegen.cpp_wrapper_gpu import CppWrapperGpu
    from torch._inductor.ir import TensorBox
    from torch._inductor.utils import DualIndentedBuffer
    from torch._inductor.virtualized import V

    wrapper = CppWrapperGpu.__new__(CppWrapperGpu)
    wrapper.prefix = DualIndentedBuffer()
    graph = SimpleNamespace(aot_mode=True, inputs_to_check=list(range(len(names))), graph_input_names=names,
                            graph_inputs={name: TensorBox.__new__(TensorBox) for name in names})
    with V.set_graph_handler(graph), mock.patch.object(CppWrapperCpu, "codegen_inputs", lambda self: None):
        wrapper.codegen_inputs()
    return wrapper.prefix.aot.getvalue()


def with_source(package, source: str, path):
    """A copy of a package whose wrapper code is `source`."""
    with zipfile.ZipFile(package) as old, zipfile.ZipFile(path, "w") as new:
        for item in old.infolist():
            data = old.read(item)
            new.writestr(item, source.encode() if item.filename.endswith(".wrapper.cpp") else data)
    return path


def test_the_cuda_inputs_alignment_guards_are_not_cache_copies(fused_step, tmp_path):
    """step_b1.pt2 on the H200 reported "16 clone calls": one alignment guard per input, not a copy per call."""
    decoder, _, package = fused_step(1)
    source = wrapper_source(package)
    names = input_names(source)
    guards = gpu_alignment_guards(names)
    assert guards.count("aoti_torch_clone_preserve_strides(") == len(names) == 16
    last = f"auto {names[-1]} = std::move(inputs[{len(names) - 1}]);\n"
    guarded = source.replace(last, last + guards)  # where the CUDA wrapper has them: after taking the inputs
    layer = decoder.cache.k[0].numel()
    assert alignment_guards(guarded) == names
    assert cache_copies(with_source(package, guarded, tmp_path / "guarded.pt2"), layer) == []
    copied = guarded.replace(last, last + f"AtenTensorHandle copy; aoti_torch_clone({names[1]}, &copy);\n")
    assert cache_copies(with_source(package, copied, tmp_path / "copied.pt2"), layer) == ["1 clone calls"]


class ViewWrite(torch.nn.Module):
    """The cache write Talker.step used to make: into the layer's view, which functionalisation copies."""

    def forward(self, x: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])
        for i in range(k.shape[0]):
            k[i][rows, :, lengths] = x[:, None, :].expand(-1, k.shape[2], -1) * (i + 1)
            x = x + k[i].sum((1, 2))
        return x


def test_a_write_into_a_view_of_the_cache_is_found(tmp_path):
    x, k, lengths = torch.randn(2, 16), torch.zeros(3, 2, 2, 128, 16), torch.tensor([3, 5])
    with torch.no_grad():
        program = torch.export.export(ViewWrite(), (x, k, lengths), strict=False).run_decompositions()
    generate_code(program, tmp_path / "view.pt2")
    copies = cache_copies(tmp_path / "view.pt2", k[0].numel())
    assert "a buffer of shape [2, 2, 128, 16]" in copies  # a layer (Inductor also copies the whole cache)
    assert all(c in ("a buffer of shape [2, 2, 128, 16]", "a buffer of shape [3, 2, 2, 128, 16]") for c in copies)


FALLBACK_LINES = """
import logging, sys
import torch
from tests.test_export_nocopy import export_fused_step, generate_code

_, program = export_fused_step(sys.argv[1], 1)
torch._logging.set_logs(inductor=logging.INFO)
generate_code(program, sys.argv[2])
"""


def test_inductors_fallback_lines_name_the_fused_ops_arguments(small_model, tmp_path):
    """Inductor's line for each higgs-rt op it falls back to (built eagerly by torch 2.11 in every process's first
    compile, log or not; here with the log on) names the arguments: an IR node's own text nests its inputs',
    exponential in the op chain's depth (the 28-layer CUDA step package's compile never ended)."""
    done = subprocess.run([sys.executable, "-c", FALLBACK_LINES, str(small_model), str(tmp_path / "step_b1.pt2")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split("] ", 1)[-1] for line in done.stderr.splitlines() if "graph.py" in line]
    blocks = "\n".join(lines).split("Creating implicit fallback for:")[1:]
    ops = {re.search(r"target: higgs_rt\.(\w+)", block).group(1) for block in blocks}
    assert {"norm_qkv_rope", "decode_attention", "gemv_residual", "norm_gemv_silu", "norm_gemv_logits"} <= ops
    longest = max(len(block.strip().splitlines()) for block in blocks)
    assert longest <= 24, f"a fallback line of {longest} lines: an argument printed with its input chain"
