"""`python -m qwen_np ...`: the command line (see qwen_np/cli.py)."""

import sys

from .cli import main

sys.exit(main(prog="python -m qwen_np"))
