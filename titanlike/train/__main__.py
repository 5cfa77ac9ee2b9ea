"""`python -m titanlike.train ...`: train.py without a checkout (torchrun -m titanlike.train too)."""

import sys

from titanlike.cli.train import main

sys.exit(main(prog="python -m titanlike.train", process=True))
