"""The one exception qwen_np raises for bad input."""


class QwenNPError(Exception):
    """The one exception qwen_np raises for bad files, configs and arguments; its message names the file, tensor or flag."""
