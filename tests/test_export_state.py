"""The decode-step state contract: the KV cache and the sampler declare the tensors a step reads and writes
(`STATE`), export traces exactly those as the step's inputs and refuses a step that writes anything else."""

from __future__ import annotations

import pytest
import torch

from higgs_rt.compiled import state_spec, step_state
from higgs_rt.generate import Decoder
from higgs_rt.sampling import FrameSampler
from higgs_rt.talker import KVCache, Talker
from tools.export.programs import export_step

CONTEXT = 64


@pytest.fixture(scope="module")
def talker(random_model):
    return Talker.from_pretrained(random_model, max_positions=CONTEXT)


def test_every_tensor_the_cache_and_sampler_hold_is_declared(talker):
    decoder = Decoder(talker, batch=2, context=CONTEXT)
    for owner, constants in ((decoder.cache, set()), (decoder.sampler, {"codebooks"})):
        tensors = {name for name, value in vars(owner).items() if isinstance(value, torch.Tensor)}
        # a new per-slot tensor must be declared, or every exported step would bake in its export-time value
        assert tensors - constants == set(type(owner).STATE), type(owner).__name__


def test_the_spec_names_shapes_dtypes_and_writes_of_the_declared_tensors(talker):
    cfg = talker.cfg
    decoder = Decoder(talker, batch=2, context=CONTEXT, ras_window=5)
    kv = [cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim]
    assert state_spec(decoder) == [
        ["cache.k", kv, "float32", True], ["cache.v", kv, "float32", True], ["cache.lengths", [2], "int64", True],
        ["cache.attention_counters", [2 * cfg.num_heads], "int32", True],
        ["sampler.seeds", [2], "int64", False], ["sampler.frame", [2], "int64", True],
        ["sampler.eos_start", [2], "int64", True], ["sampler.done", [2], "bool", True],
        ["sampler.history", [2, 5, cfg.num_codebooks], "int64", True], ["sampler.temperature", [2], "float32", False],
        ["sampler.top_k", [2], "int64", False], ["sampler.top_p", [2], "float32", False],
        ["sampler.greedy", [2], "bool", False], ["sampler.ras_on", [2], "bool", False],
        ["sampler.ras_max", [2], "int64", False]]
    state = step_state(decoder)
    assert state["cache.k"] is decoder.cache.k and state["sampler.history"] is decoder.sampler.history


def test_the_exported_step_takes_the_declared_state_and_writes_what_is_declared_written(talker):
    decoder = Decoder(talker, batch=1, context=CONTEXT)
    with torch.no_grad():
        program = export_step(decoder)
    signature = program.graph_signature
    names = dict(zip(signature.user_inputs, ["frames", *step_state(decoder)]))
    assert len(signature.user_inputs) == 1 + len(state_spec(decoder))
    # the CPU step leaves decode_attention's counters alone; everything else declared written is written
    assert {names[n] for n in signature.user_inputs_to_mutate.values()} == {
        "cache.k", "cache.v", "cache.lengths", "sampler.frame", "sampler.eos_start", "sampler.done",
        "sampler.history"}


@pytest.mark.parametrize("written, declare", [
    ("done", lambda state: {**state, "done": False}),  # written but declared read-only
    ("frame", lambda state: {name: w for name, w in state.items() if name != "frame"}),  # not declared at all
], ids=["declared-read-only", "undeclared"])
def test_export_refuses_a_step_that_writes_undeclared_state(talker, monkeypatch, written, declare):
    monkeypatch.setattr(FrameSampler, "STATE", declare(FrameSampler.STATE))
    with torch.no_grad(), pytest.raises(ValueError, match=f"the decode step writes sampler.{written}, which the "
                                                          "owner's STATE does not declare written"):
        export_step(Decoder(talker, batch=1, context=CONTEXT))


def test_what_the_fused_kernels_write_is_declared_written():
    """On CUDA the step is the fused kernels: the arguments their C++ schemas mark written (csrc/library.cpp) are
    the state tensors Talker.fused_step and FrameSampler.step pass there."""
    passed = {("norm_qkv_rope", "k_cache"): "cache.k", ("norm_qkv_rope", "v_cache"): "cache.v",
              ("decode_attention", "counters"): "cache.attention_counters",
              ("sample_frame", "lengths"): "cache.lengths",
              **{("sample_frame", name): f"sampler.{name}" for name in ("frame", "eos_start", "done", "history")}}
    written = {(op, arg.name) for op in ("norm_qkv_rope", "decode_attention", "sample_frame")
               for arg in getattr(torch.ops.higgs_rt, op).default._schema.arguments
               if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == set(passed)
    declared = {f"{owner}.{name}" for owner, cls in (("cache", KVCache), ("sampler", FrameSampler))
                for name, w in cls.STATE.items() if w}
    assert set(passed.values()) <= declared
