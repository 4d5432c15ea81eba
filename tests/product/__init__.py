"""The whole product: README's code, the walkthrough and its exercises, the wheel, and the import rules of
qwen_np/'s folders (test_import_rules.py)."""
