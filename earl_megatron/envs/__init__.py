"""Environments: OpenSpiel games and tool-use environments, registered by name."""
