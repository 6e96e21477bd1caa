"""Benchmarks of the message queue (``groupcoord bench mq``).

Not part of the library API: nothing under :mod:`shm_broadcast` outside this
package imports it.

Modules:
    mq: queue latency and throughput vs the baselines.
    baselines: gloo broadcast and pickle+zmq, measured in the same run.
    payloads: the payload shapes measured.
    wake: the platform's wake-up floor (a datagram socket ping-pong).
    hotpath: the queue's own CPU cost per message, in one process.
"""
