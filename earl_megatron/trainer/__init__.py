"""The agentic RL trainer: data path, loop pieces, runner, report."""
