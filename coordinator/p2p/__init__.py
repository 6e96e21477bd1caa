"""Point-to-point: shared-memory links, tensor dicts on the wire, issue-ordered channels, async p2p."""
