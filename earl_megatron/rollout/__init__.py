"""Rollout engines (embedded Megatron-Core, SGLang) and the multi-turn agent loop."""
