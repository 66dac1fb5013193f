"""Megatron-Core GPTModel providers for the Llama/Qwen2 family and CP attention without TE."""
