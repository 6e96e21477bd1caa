"""Files that are never lost: shared-memory segments, owner records, channel directories, exit cleanup and the reaper."""
