"""No copy of the KV cache inside an exported decode step: the generated wrapper code of the step package
allocates nothing as large as one layer of the cache and clones nothing (`tools.export.buffers`).

Packages are generated as C++ sources only (`aot_inductor.package_cpp_only`: Inductor's whole lowering and code
generation, without compiling), so this runs in seconds; the full export in test_export_host.py checks the
compiled package's record. The fused CUDA step (higgs-rt's C++ ops, whose schemas declare the cache writes) is
traced here on the CPU with the ops' kernels switched on: only its fake kernels run, and the code Inductor
generates around the ops is what decides whether the cache is copied.
"""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

import higgs_rt.ops
from higgs_rt.cli import main
from higgs_rt.generate import Decoder
from higgs_rt.talker import Talker
from higgs_rt.torch_compat import aoti_compile_and_package
from tools.export.buffers import allocations, cache_copies, wrapper_source
from tools.export.build import package_configs
from tools.export.programs import export_step

CONTEXT = 256
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


def test_the_fused_step_passes_the_cache_to_its_kernels_without_a_copy(small_model, tmp_path):
    talker = Talker.from_pretrained(small_model, dtype=torch.bfloat16, max_positions=CONTEXT)
    decoder = Decoder(talker, batch=2, context=CONTEXT)
    on = lambda *args: True  # noqa: E731
    with mock.patch.object(Talker, "decode_kernels", True), \
            mock.patch.object(sys.modules["higgs_rt.ops.gemv"], "_kernel", on), \
            mock.patch.object(sys.modules["higgs_rt.ops.attention"], "cuda_kernel", on), \
            mock.patch.object(higgs_rt.ops, "sample_frame_supported", on), torch.no_grad():
        program = export_step(decoder)
    called = {n.target.name() for n in program.graph.nodes if getattr(n.target, "namespace", None) == "higgs_rt"}
    assert {"higgs_rt::norm_gemv_silu", "higgs_rt::gemv_residual", "higgs_rt::norm_gemv_logits"} <= called
    functionalized = [n for n in program.graph.nodes if "auto_functionalized" in str(n.target)]
    assert {n.args[0].name() for n in functionalized} == {
        "higgs_rt::norm_qkv_rope", "higgs_rt::decode_attention", "higgs_rt::sample_frame"}
    generate_code(program, tmp_path / "step.pt2")
    assert cache_copies(tmp_path / "step.pt2", decoder.cache.k[0].numel()) == []


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
