"""The CPU communicator: shared memory among a node's ranks, gloo or a hierarchical path
across nodes."""
