"""`python -m tools.export ...` is `higgs-rt export ...`."""

import sys

from higgs_rt.cli import main

sys.exit(main(["export", *sys.argv[1:]]))
