"""Megatron-Core GPTModel providers for the Llama/Qwen2/Qwen3 family and CP attention without TE."""
