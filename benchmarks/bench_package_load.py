"""Loading one AOTInductor package in a fresh process: torch's `aoti_load_package` against higgs-rt's loader.

`torch._inductor.aoti_load_package` first surveys the device, compiling and loading CPU test programs with the
C++ compiler, only to log a mismatch; `higgs_rt.compiled._load_package` skips that (the manifest checks device
and arch). The package is `tools.export.loadcheck`'s one-layer `weights-apart` package, built once; each loader
then runs in its own fresh process (after torch import and device init), which loads, binds the weights and
runs it once.

    python benchmarks/bench_package_load.py [--device cuda] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LOADERS = ("torch", "higgs-rt")


def child(loader: str, path: str, device: str) -> dict:
    from higgs_rt.compiled import _load_package
    from tools.export.loadcheck import OneLayer, inputs

    torch.manual_seed(0)  # the weights loadcheck.build exported with
    model = OneLayer(custom_op=False).to(device).eval()
    weights = dict(model.state_dict())
    start = time.perf_counter()
    if loader == "torch":
        package = torch._inductor.aoti_load_package(path, device_index=0 if device == "cuda" else -1)
        package.load_constants({n: weights[n] for n in package.get_constant_fqns()}, check_full_update=True,
                               user_managed=True)
    else:
        package = _load_package(Path(path), weights, torch.device(device), single_threaded=False)
    loaded = time.perf_counter()
    with torch.no_grad():
        got = package(*inputs(device))
        got = got[0] if isinstance(got, list) else got  # higgs-rt's Package returns the flat outputs
        torch.testing.assert_close(got, model(*inputs(device)), rtol=1e-4, atol=1e-4)
    return {"load_s": loaded - start, "first_run_s": time.perf_counter() - loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=2, help="fresh processes per loader")
    ap.add_argument("--child", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.device)))
        return

    from tools.export.loadcheck import build
    from tools.export.toolchain import choose_cxx

    cxx, note = choose_cxx()
    result = {"device": args.device, "torch_version": torch.__version__, "compiler": note}
    with tempfile.TemporaryDirectory(prefix="higgs-rt-bench-load-") as tmp:
        start = time.perf_counter()
        path = build("weights-apart", Path(tmp), args.device, cxx)
        result["build_s"] = time.perf_counter() - start
        for loader in LOADERS * args.repeat:
            proc = subprocess.run([sys.executable, __file__, "--device", args.device, "--child", loader, str(path)],
                                  cwd=ROOT, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            run = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {"error": proc.stderr.strip()[-500:]}
            result.setdefault(loader, []).append(run)
            print(f"{loader:>9}: {run}", flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
