"""The conversation caches: the tracked (growing) cache, the sink + recent window and the
preallocated buffers."""
