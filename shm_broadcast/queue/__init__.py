"""The message queue: one writer, local readers over a shared ring, remote readers over CURVE zmq."""
