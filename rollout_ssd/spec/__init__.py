"""Speculation: verification (pure functions over tensors) and speculators behind one interface."""
