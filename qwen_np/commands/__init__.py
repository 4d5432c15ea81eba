"""The commands of `python -m qwen_np`: each module here owns one command's flags, printing and figures,
and calls the library with plain arguments; qwen_np/cli.py assembles the parser and runs them."""
