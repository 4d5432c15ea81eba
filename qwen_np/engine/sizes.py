"""Sizes as people write them ("512MiB", "2GiB", "1.5GB"), read and printed: serve's --kv-memory and the
sizes it reports.
"""

from __future__ import annotations

import re

from ..errors import QwenNPError

GiB = 1024 ** 3

# Units of a size (serve's --kv-memory 512MiB): binary (KiB = 1024) and decimal (KB = 1000), as written
# by people; hand-written (a regex and a table): no library in our dependencies reads them.
SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
              "g": GiB, "gb": 1000 ** 3, "gib": GiB, "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, param: str) -> int:
    """Bytes in a size such as "512MiB", "2GiB", "1.5GB" or "4096" (bytes); a QwenNPError about `param` (the
    caller's parameter the text came from, e.g. "kv_memory") if it is not one."""
    match = SIZE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise QwenNPError(f"expected a size such as 512MiB or 2GiB, got {text!r}", param)
    return int(float(match[1]) * SIZE_UNITS[unit])


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1: "512.0 MiB", "2.00 GiB"."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"
