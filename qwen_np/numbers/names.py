"""The number formats by name, in a module that imports nothing (not even NumPy), so that the command line's
--help shows them (core/defaults.py hands them on) without loading the formats themselves (formats.py).
"""

# The weight formats the precision lab compares (formats.FORMAT_TABLE holds them, in this order).
FORMATS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rows", "fp8_e5m2_rows", "int8", "q8_0", "q4_0",
           "mxfp4")
# The block formats a matrix can be quantized to at load (formats.FormatRows): load_model's modes besides
# fp32, bf16 and int8 (core/defaults.MODES).
HELD_FORMATS = ("q8_0", "q4_0")
