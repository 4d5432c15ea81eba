"""The whole product: README's code, the walkthrough and its exercises, the wheel."""
