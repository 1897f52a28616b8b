"""The DiT service: receives streamed AR hidden states, renders images with diffusers."""

__version__ = "0.1.0"
