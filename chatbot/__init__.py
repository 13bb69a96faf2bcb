"""chatbot: an interactive terminal chatbot for local language models."""

__version__ = "0.1.0"
DISTRIBUTION = "chatbot-local"
"""The name pip knows the package by (`chatbot` on PyPI is another project); the command and
the import package are `chatbot`."""
