"""Which AOTInductor package features load and run on this machine: for when `higgs-rt export` stops at its probe.

    python -m tools.export.loadcheck [--device cuda] [--features plain ...] [--cxx g++]

Each feature is one tiny package (a Linear layer; `custom-op` adds higgs-rt's `rvq_lookup` kernel, called through
AOTInductor's proxy executor; `weights-apart` compiles without the weights, `package_constants_in_so=False`, and
binds them at load as higgs-rt does). Each is loaded and run in its own process, so a crash names its feature and
stage. higgs-rt's packages use `custom-op+weights-apart`. The C++ compiler is chosen as `higgs-rt export` chooses
it (`toolchain.choose_cxx`), so `--cxx` tries another.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from higgs_rt import ops
from higgs_rt.torch_compat import aoti_compile_and_package, load_package

from .probe import run_staged, stage
from .toolchain import choose_cxx, inductor_configs

FEATURES = ("plain", "weights-apart", "custom-op", "custom-op+weights-apart")


class OneLayer(nn.Module):
    def __init__(self, custom_op: bool):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.table = nn.Buffer(torch.randn(2, 4, 16))
        self.custom_op = custom_op

    def forward(self, x: Tensor, codes: Tensor) -> Tensor:
        y = self.linear(x)
        return y + ops.rvq_lookup(codes, self.table) if self.custom_op else y


def inputs(device: str) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 3, 16, generator=gen).to(device), torch.randint(0, 4, (1, 3, 2), generator=gen).to(device)


def build(feature: str, directory: Path, device: str, cxx: str | None) -> Path:
    torch.manual_seed(0)
    model = OneLayer("custom-op" in feature).to(device).eval()
    path = directory / f"{feature}.pt2"
    with torch.no_grad():
        program = torch.export.export(model, inputs(device), strict=False)
        aoti_compile_and_package(program, path, {"aot_inductor.package_constants_in_so": "weights-apart" not in feature,
                                                 **inductor_configs(cxx)})
    return path


def child(feature: str, path: str, device: str) -> None:
    torch.manual_seed(0)
    model = OneLayer("custom-op" in feature).to(device).eval()
    stage("loading")
    package = load_package(Path(path), 0 if device == "cuda" else -1)  # as the runtime loads them
    if "weights-apart" in feature:
        stage("binding weights")
        weights = dict(model.state_dict())
        package.bind_constants({n: weights[n] for n in package.constant_names()})
    stage("running")
    with torch.no_grad():
        got, want = package(*inputs(device))[0], model(*inputs(device))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    stage("ok")


def check(feature: str, path: Path, device: str) -> str:
    ended = run_staged([sys.executable, "-m", "tools.export.loadcheck", "--child", feature, str(path), "--device",
                        device], cwd=Path(__file__).resolve().parents[2])
    return "ok" if ended is None else " ".join(ended)


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--features", nargs="+", choices=FEATURES, default=list(FEATURES))
    ap.add_argument("--cxx", help="C++ compiler for the packages (default: as `higgs-rt export` chooses)")
    ap.add_argument("--child", nargs=2, metavar=("FEATURE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child, args.device)
        return {}
    cxx, note = choose_cxx(args.cxx)
    print(f"torch {torch.__version__}, {args.device}; {note}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="higgs-rt-loadcheck-") as tmp:
        for feature in args.features:
            results[feature] = check(feature, build(feature, Path(tmp), args.device, cxx), args.device)
            print(f"{feature:>24}: {results[feature]}", flush=True)
    return results


if __name__ == "__main__":
    main()
