"""Reference tooling: transformers-built Qwen3 models and logit comparison helpers.

`hf_reference` needs the `reference` extra (torch + transformers); `logit_match` needs
only NumPy, so tests that read stored fixtures can import it without torch.
"""
