"""Numbers: how a weight is held (`numerics`: FP32 arrays, stored BF16/F16 rows, int8 rows, panels, each
widened to FP32 by one `widen()`) and the number formats (`formats`: quantize / dequantize, bits per weight).

May import: qwen_np.errors only. The bottom of the house.
"""
