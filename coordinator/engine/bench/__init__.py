"""``groupcoord bench engine``: the demo's step loop without the model.

A driver (TP rank 0) broadcasts one metadata message per step through the TP
group's message-queue broadcaster on a fixed clock (``--step-ms``); every rank
then runs one TP ``all_reduce`` per simulated layer. Optionally a background
compute load keeps the cores busy (torch matmuls in a thread of every rank, or
in one extra process per rank). Reported per rank: metadata arrival latency
(workers), the driver's enqueue time, ``all_reduce`` latency, the CPU the
waiting thread spent in ``dequeue`` and the rank's process CPU -- per wait
policy when several are compared in one run (interleaved blocks).

Modules: :mod:`~coordinator.engine.bench.loop` (what each rank runs),
:mod:`~coordinator.engine.bench.load` (background load),
:mod:`~coordinator.engine.bench.report` (statistics, table, plot),
:mod:`~coordinator.engine.bench.cli` (options, running it).
"""
