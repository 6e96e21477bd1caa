"""The model-parallel layout: world start-up, rank mesh, extra groups, expert parallelism, sharding arithmetic."""
