"""Files that are never lost.

Shared-memory segments, owner records, channel directories, exit cleanup and the reaper.
"""
