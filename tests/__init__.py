"""The suite, one folder per subpackage of qwen_np/ (tests/core tests qwen_np/core, ...) and tests/product for
the whole product (README, walkthrough, packaging). A package, so that its folders may share a basename
(tests/numbers beside the standard library's numbers) and a test imports a helper of another by its full
name: `from tests.serving.test_serve import serving`, `from tests.conftest import QWEN3_RANDOM`.
"""
