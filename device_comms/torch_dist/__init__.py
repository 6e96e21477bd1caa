"""Communicators over a torch.distributed group (gloo, or NCCL for CUDA tensors)."""
