"""The token-in/token-out core of an OpenAI-compatible agent endpoint: chat requests to prompt
ids (chat.py), model replies to content and tool calls (tool_parsers.py), and one episode's
requests and replies to training rows (trajectory.py). No server here: the HTTP layer calls these
pure pieces."""
