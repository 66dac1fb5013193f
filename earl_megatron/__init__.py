"""earl_megatron: Megatron-Core-native agentic RL with per-stage parallel layouts.

Importing the package has no side effects: no device probing, no patching, no process groups.
"""

__version__ = "0.1.0"
