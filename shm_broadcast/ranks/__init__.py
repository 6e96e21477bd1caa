"""Rank plumbing: local launcher, TCP stores, object exchanges over groups, argument agreement, node topology."""
