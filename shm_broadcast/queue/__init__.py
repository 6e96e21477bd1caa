"""The message queue.

One writer; local readers over a shared ring, remote readers over CURVE zmq.
"""
