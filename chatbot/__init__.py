"""chatbot: an interactive terminal chatbot for local language models."""

__version__ = "0.1.0"
