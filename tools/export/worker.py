"""One package of an export in a process of its own (`export_artifacts(jobs=N)` runs N at once): load what the
package needs as the runtime does, export and compile it (`build.package`), write its manifest entry as JSON.
Its log lines go to stderr, for the exporting process to pass on.

    python -m tools.export.worker SPEC_JSON   (run by export_artifacts)
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

from higgs_rt import ops
from higgs_rt.codec import load_codec
from higgs_rt.model import resolve_dtype
from higgs_rt.talker import Talker

from .build import package


def main(spec: dict) -> None:
    device = torch.device(spec["device"])
    dtype = resolve_dtype(spec["dtype"], device)
    codec_only = spec["what"] == "codec"
    talker = None if codec_only else Talker.from_pretrained(spec["model"], dtype=dtype, device=device,
                                                            max_positions=spec["context"])
    code2wav = load_codec(spec["codec"], device=device) if codec_only else None
    tracing = ops.references() if spec["kernels"] == "torch" else contextlib.nullcontext()
    with torch.no_grad(), tracing:
        name, entry = package(spec["what"], spec["batch"], talker, code2wav, Path(spec["out"]), device, spec["cxx"],
                              spec["context"], lambda line: print(line, file=sys.stderr, flush=True))
    Path(spec["result"]).write_text(json.dumps([name, entry]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
