"""The commands of `python -m qwen_np`: each module here owns one command's flags, printing and figures,
and calls the library with plain arguments; qwen_np/cli.py assembles the parser and runs them. Each
module's PARSERS maps its commands to the functions that build their parsers (description, flags, run).

Also the exit codes every command ends with (besides 0).
"""

EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130   # every bad input; Ctrl-C (128 + SIGINT, as shells report it)
