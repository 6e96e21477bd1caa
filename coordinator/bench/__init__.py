"""Benchmarks of the coordinator layer; no library module imports them.

``groupcoord bench engine`` runs the demo's step loop without the model. A
driver (TP rank 0) broadcasts one metadata message per step through the TP

group's message-queue broadcaster on a fixed clock (``--step-ms``); every rank
then runs one TP ``all_reduce`` per simulated layer. Optionally a background
compute load keeps the cores busy (torch matmuls in a thread of every rank, or
in one extra process per rank). Reported per rank: metadata arrival latency
(workers), the driver's enqueue time, ``all_reduce`` latency, the CPU the
waiting thread spent in ``dequeue`` and the rank's process CPU -- per wait
policy when several are compared in one run (interleaved blocks).

Modules: :mod:`~coordinator.bench.loop` (what each rank runs),
:mod:`~coordinator.bench.load` (background load),
:mod:`~coordinator.bench.report` (statistics, table, plot),
:mod:`~coordinator.bench.cli` (options, running it).

``groupcoord bench p2p`` (:mod:`~coordinator.bench.p2p`) moves tensor dicts and
single tensors between two pipeline stages: shared-memory links against the
CPU group and plain gloo.
"""
