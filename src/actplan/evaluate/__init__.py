"""Checking a plan on a model: ``verify`` (exactness, step by step) and ``bench`` (every policy
side by side: parity, memory, interleaved step times)."""
