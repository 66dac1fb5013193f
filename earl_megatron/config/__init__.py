"""Frozen configuration dataclasses; Hydra is converted to these once, at the entry point."""
