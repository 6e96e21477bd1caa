"""Benchmarks of the device communicators (``groupcoord bench collectives``).

Not part of the library API: nothing under :mod:`device_comms` outside this
package imports it.

Modules:
    collectives: CPU shared-memory collectives vs gloo, over real processes.
    dispatch_combine: one MoE layer's traffic (the ``dispatch_combine`` op of collectives).
    cuda: the GPU all-reduce table (custom all-reduce, PyNccl, torch NCCL).
    report: tables and plots of the results.

Ranks are started by :func:`shm_broadcast.ranks.launcher.spawn_group`.
"""
