"""Process groups outside torch.distributed's global state, over a sealed TCP store."""
