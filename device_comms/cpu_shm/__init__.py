"""The shared-memory collective engine of one node: workspace, lock-free step sync, and its ops."""
