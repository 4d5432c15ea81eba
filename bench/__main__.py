"""`python -m bench`: see bench/run.py and bench/README.md."""

from .run import main

main()
