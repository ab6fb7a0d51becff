"""Write random Higgs-Audio v2 checkpoints in the real layouts (noise, not speech).

    python tools/make_checkpoint.py DIR --size tiny|full [--layout transformers|boson] [--codec]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from higgs_rt.fixtures.talker import SIZES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--layout", choices=("transformers", "boson"), default="transformers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codec", action="store_true", help="also write a random codec under OUT_DIR/codec")
    args = ap.parse_args(argv)

    from higgs_rt.fixtures.talker import make_talker

    make_talker(args.out_dir, args.size, layout=args.layout, seed=args.seed)
    print(f"talker ({args.size}, {args.layout} layout) -> {args.out_dir}")
    if args.codec:
        from higgs_rt.fixtures.codec import make_codec

        codec_size = "full" if args.size == "full" else "tiny"
        make_codec(args.out_dir / "codec", codec_size, layout=args.layout, seed=args.seed)
        print(f"codec ({codec_size}) -> {args.out_dir / 'codec'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
