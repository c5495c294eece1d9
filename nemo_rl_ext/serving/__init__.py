"""The OpenAI-compatible policy server: request schemas, token-exact chat prompts, guards, the threaded server."""
