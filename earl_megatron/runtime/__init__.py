"""Side effects: process groups (the one bridge to parallel_state), CPU backend, step runner."""
