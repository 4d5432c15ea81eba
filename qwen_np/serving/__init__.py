"""Serving: the OpenAI-compatible HTTP API (`server`), its /metrics (`metrics`), and the web explorer
(`explorer`, the page in web/).

May import: everything below the commands (generation/, inspection/, engine/, files/, core/, numbers/).
"""
