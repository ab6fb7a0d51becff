"""Private torch APIs only in higgs_rt/torch_compat.py, gated by torch version: an unsupported torch gets one clear
line from `higgs-rt export` and a warning plus the eager path from the runtime."""

from __future__ import annotations

import ast
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import higgs_rt.torch_compat as compat
from higgs_rt.cli import main
from higgs_rt.codec import load_codec
from higgs_rt.compiled import CODEC, MANIFEST, PREFILL, CompiledArtifactsWarning, file_sha256, load_compiled, target
from higgs_rt.talker import Talker

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 64


def private_torch_uses(path: Path) -> list[str]:
    """`torch._x` attributes and imports of private torch modules in a file's code (not its comments)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for module in modules:
            if module.split(".")[0] == "torch" and any(part.startswith("_") for part in module.split(".")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} import {module}")
    return found


def test_private_torch_apis_are_used_only_by_the_compat_module():
    files = sorted((ROOT / "higgs_rt").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    uses = {str(f.relative_to(ROOT)): private_torch_uses(f) for f in files}
    assert uses.pop("higgs_rt/torch_compat.py")  # the scan finds them where they are
    assert [u for found in uses.values() for u in found] == []


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu128", "2.13.0+cpu"])
def test_tested_torch_versions_pass(version):
    compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.14.0.dev20270101+cu130", "3.0.0"])
def test_other_torch_versions_get_one_clear_error(version):
    message = (f"torch {version} is not supported by higgs-rt's exported packages (AOTInductor's APIs are private; "
               "checked with torch 2.11 to 2.13)")
    with pytest.raises(compat.UnsupportedTorch, match=f"^{re.escape(message)}$"):
        compat.check_torch(version)


def test_the_running_torch_is_supported():
    compat.check_torch()


@pytest.fixture
def unsupported(monkeypatch):
    monkeypatch.setattr(compat, "TESTED", ((1, 0), (1, 1)))


def test_export_on_an_unsupported_torch_exits_1_with_one_line(random_model, tmp_path, unsupported, capsys):
    assert main(["export", "--model", str(random_model), "--out", str(tmp_path / "out"), "--compute", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"higgs-rt: error: torch {torch.__version__} is not supported by higgs-rt's exported packages "
                   "(AOTInductor's APIs are private; checked with torch 1.0 to 1.1)"]
    assert not (tmp_path / "out").exists()


def test_the_runtime_on_an_unsupported_torch_warns_once_and_runs_eager(random_model, tmp_path, unsupported):
    talker = Talker.from_pretrained(random_model, max_positions=CONTEXT)
    codec_dir = random_model / "audio_tokenizer"
    codec = load_codec(codec_dir)
    artifacts = {}
    for name in (PREFILL, CODEC):  # never loaded: the version check comes first
        (tmp_path / name).write_bytes(b"not a package")
        artifacts[name] = {"sha256": file_sha256(tmp_path / name)}
    manifest = {**target(talker, codec, random_model, codec_dir, CONTEXT), "batch_sizes": [], "artifacts": artifacts}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = load_compiled(tmp_path, random_model, codec_dir, talker, codec, CONTEXT)
    assert compiled is None
    messages = [str(w.message) for w in caught if issubclass(w.category, CompiledArtifactsWarning)]
    assert len(messages) == 1 and f"UnsupportedTorch: torch {torch.__version__} is not supported" in messages[0]
    assert "running eager" in messages[0]


class _DeepNode:
    """Stands in for an Inductor IR node whose text would nest its whole input chain."""

    __module__ = "torch._inductor.ir"

    def get_name(self) -> str:
        return "buf7"

    def __str__(self) -> str:
        raise AssertionError("the node's full text was built")


def test_operator_text_names_ir_nodes_instead_of_printing_their_chains():
    from torch._inductor.exc import OperatorIssue

    original = OperatorIssue.operator_str
    with compat.short_operator_text():
        text = OperatorIssue.operator_str(torch.ops.higgs_rt.gemv.default, [_DeepNode(), [_DeepNode()], 1e-5],
                                          {"eps": 0.5})
    assert text.splitlines() == ["  target: higgs_rt.gemv.default", "  args[0]: _DeepNode(buf7)",
                                 "  args[1]: [_DeepNode(buf7)]", "  args[2]: 1e-05", "  kwargs: eps=0.5"]
    assert OperatorIssue.operator_str is original  # restored
    with pytest.raises(AssertionError, match="full text"):
        OperatorIssue.operator_str(torch.ops.higgs_rt.gemv.default, [_DeepNode()], {})


def test_a_compiled_decoder_keeps_inductors_fallback_lines_short(random_model, monkeypatch):
    from torch._inductor.exc import OperatorIssue

    from higgs_rt.generate import Decoder

    monkeypatch.setattr(OperatorIssue, "operator_str", OperatorIssue.__dict__["operator_str"])  # restored after
    talker = Talker.from_pretrained(random_model, max_positions=CONTEXT)
    Decoder(talker, batch=1, context=CONTEXT)
    with pytest.raises(AssertionError, match="full text"):
        OperatorIssue.operator_str(torch.ops.higgs_rt.gemv.default, [_DeepNode()], {})
    Decoder(talker, batch=1, context=CONTEXT, compile="default")  # torch.compile compiles at the first step
    assert OperatorIssue.operator_str("op", [_DeepNode()], {}) == "  target: op\n  args[0]: _DeepNode(buf7)"


def test_an_unsupported_torch_keeps_inductors_own_operator_text(monkeypatch, unsupported):
    from torch._inductor.exc import OperatorIssue

    monkeypatch.setattr(OperatorIssue, "operator_str", OperatorIssue.__dict__["operator_str"])  # restored after
    compat.use_short_operator_text()  # a private class of an unchecked torch is left alone
    with pytest.raises(AssertionError, match="full text"):
        OperatorIssue.operator_str(torch.ops.higgs_rt.gemv.default, [_DeepNode()], {})
