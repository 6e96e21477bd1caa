"""Rank plumbing.

Local launcher, TCP stores, object exchanges over groups, argument agreement, node topology.
"""
