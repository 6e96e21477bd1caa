"""Point to point: the ordered calls, their channels and handles, shared-memory links, CUDA."""
