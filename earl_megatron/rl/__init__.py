"""RL math: advantages and losses over per-token tensors (pure tensor code)."""
