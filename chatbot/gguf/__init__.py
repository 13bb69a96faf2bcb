"""The structure of a GGUF file (tensor table and metadata), read without torch."""
