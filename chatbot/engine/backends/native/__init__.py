"""The native CPU backend: the model read into C structures, its packed weights, the
kernels' build and ABI, and the threads that run them."""
