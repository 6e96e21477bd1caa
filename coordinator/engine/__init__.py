"""A small serving engine built on the coordination layer (the library's worked example).

Nothing in the coordination core imports this package; it shows how an engine
uses it and gives the demo and the end-to-end tests a real model to run:

* :mod:`coordinator.engine.layers`: tensor-parallel layers (column/row
  parallel linear, vocab-parallel embedding, norms, rotary) with
  checkpoint-sharding weight loaders;
* :mod:`coordinator.engine.models`: a Llama decoder, KV cache, pipeline
  stages, a runner and greedy generation;
* :mod:`coordinator.engine.demo`: ``groupcoord demo``, a sharded model on CPU
  processes checked against an unsharded reference.
"""
