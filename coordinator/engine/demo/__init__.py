"""Demos run by ``groupcoord demo``."""
