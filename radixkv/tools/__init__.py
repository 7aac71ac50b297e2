"""Tools outside the serving path: the terminal chat client and the agent-transcript loaders."""
