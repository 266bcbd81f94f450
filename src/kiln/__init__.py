"""kiln: an LLM stack from tokens to silicon."""

__version__ = "0.1.0"
