"""The model-parallel layout.

World start-up, rank mesh, extra groups, expert parallelism, sharding arithmetic.
"""
