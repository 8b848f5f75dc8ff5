"""Connectors that plug kvstore into inference engines (``kvstore.connectors.hf`` for HF transformers)."""
