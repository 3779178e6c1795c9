"""What the tests share: tiny checkpoints (`models`), transformers as the reference (`hf_reference`),
exact target laws by enumeration (`laws`) and the one goodness-of-fit test against them (`stats`).

Shared pytest fixtures live in tests/conftest.py; this package holds plain functions, so a test file
imports exactly what it uses.
"""
