"""CUDA transports: the CUDA communicator, NCCL through ctypes, and the custom all-reduce
over CUDA IPC."""
