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
    hardware.py   the machine's topology and read rates (`hardware`)

The names below are imported when first used (PEP 562), as qwen_np's own are: `hardware` and
`inspect` then load only what they use (the machine's probes need no model code).

May import: engine/, files/, core/, numbers/, qwen_np.errors.
"""

from importlib import import_module
from typing import Any

# public name -> (the module that defines it, its name there)
_PUBLIC = {
    "SYMBOL_MEANINGS": ("qwen_np.core.config", "DIMENSIONS"),
    **{name: ("qwen_np.core.config", name) for name in ("dimensions", "evaluate", "resolve")},
    **{name: ("qwen_np.inspection.attention", name) for name in ("attention_view", "attention_weights")},
    "measure_bandwidth": ("qwen_np.inspection.bandwidth", "measure_bandwidth"),
    **{name: ("qwen_np.inspection.figures", name) for name in ("attention_figure", "heatmap_pixels", "save_attention_png")},
    **{name: ("qwen_np.inspection.counts", name)
       for name in ("forward_flops", "parameter_summary", "weight_bytes_read_per_token", "weight_tensors")},
    **{name: ("qwen_np.inspection.lens", name) for name in ("lens_probabilities", "logit_lens")},
    "write_png": ("qwen_np.inspection.png", "write_png"),
    **{name: ("qwen_np.inspection.report", name) for name in ("inspect_command", "inspect_report", "render_report")},
    **{name: ("qwen_np.inspection.steps", name) for name in ("STEPS", "STEPS_BY_NAME", "Shape", "Step", "format_shape")},
    **{name: ("qwen_np.inspection.text", name) for name in ("pad", "token_text")},
    **{name: ("qwen_np.inspection.trace", name) for name in ("Tracer", "trace_row")},
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value          # found once, then a plain attribute
        return value
    raise AttributeError(f"module 'qwen_np.inspection' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
