"""Numbers: how a weight is held (`numerics`: FP32 arrays, stored BF16/F16 rows, int8 rows, panels, each
widened to FP32 by one `widen()`), the number formats (`formats`: quantize / dequantize, bits per weight;
`names`: their names, importing nothing, for --help), and llama.cpp's other block kinds (`ggml_blocks`: held
as a GGUF's bytes; `ggml_repacked`: Q8_0, Q4_0, Q4_K and Q6_K repacked at load; `ggml_checks`: inf and NaN
found in a file's values and block scales).

May import: qwen_np.errors only. The bottom of the house.
"""
