"""Adapters for models actplan does not own (``hf``: Hugging Face ``transformers``)."""
