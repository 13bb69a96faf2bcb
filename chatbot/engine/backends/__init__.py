"""What runs the forward passes: transformers, compiled and the native CPU kernels; one is
chosen when a model loads."""
