"""GroupCoordinator and the parts it is built from.

Setup and registry, the call book, object and tensor-dict calls, queues and barriers.
"""
