"""See inside the model: every step's shapes, live traces, the logit lens, and attention heatmaps.

Everything here is built on one table, steps.STEPS: the steps of a forward pass in the order
`Qwen3Model.forward` runs them, each with its trace name, the qwen_np function that does the math,
and its input/output/weight shapes written in the dimension vocabulary of config.py. `inspect`
(report.py) resolves those symbols against a config (no weights needed), the Tracer (trace.py)
prints them next to the live arrays of a real forward pass, and docs/walkthrough.md is generated
from them, so the three can never disagree about what the model does.

    steps.py      the STEPS table            counts.py     parameters, FLOPs, bytes per token
    report.py     `inspect`, text and JSON   bandwidth.py  the rough bandwidth probe it uses
    trace.py      Tracer                     lens.py       the logit lens
    attention.py  the attention view         png.py, text.py   a PNG writer, token text
    figures.py    labelled heatmaps (matplotlib)
"""

from ..core.config import DIMENSIONS as SYMBOL_MEANINGS
from ..core.config import dimensions, evaluate, resolve
from .attention import attention_view, attention_weights
from .bandwidth import measure_bandwidth
from .figures import attention_figure, heatmap_pixels, save_attention_png
from .counts import forward_flops, parameter_summary, weight_bytes_read_per_token, weight_tensors
from .lens import lens_probabilities, logit_lens
from .png import write_png
from .report import inspect_command, inspect_report, render_report
from .steps import STEPS, STEPS_BY_NAME, Shape, Step, format_shape
from .text import pad, token_text
from .trace import Tracer, trace_row

__all__ = ["STEPS", "STEPS_BY_NAME", "SYMBOL_MEANINGS", "Shape", "Step", "Tracer", "attention_view",
           "attention_figure", "attention_weights", "dimensions", "evaluate", "forward_flops", "format_shape", "heatmap_pixels",
           "inspect_command", "inspect_report", "lens_probabilities", "logit_lens", "measure_bandwidth", "pad",
           "parameter_summary", "render_report", "resolve", "save_attention_png", "token_text", "trace_row",
           "weight_bytes_read_per_token", "weight_tensors", "write_png"]
