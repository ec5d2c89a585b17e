"""Streams bucketed weights from a Megatron-Core model to inference engines.
Not implemented yet (issue: export hook)."""
