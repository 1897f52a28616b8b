"""The AR service: vLLM with hidden-state capture, the public OpenAI image API, the handoff client."""

__version__ = "0.1.0"
