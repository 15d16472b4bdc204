"""Executing plans: ``parallelize(model, plan)`` (in :mod:`autopar.runtime.api`, also
``autopar.parallelize``) returns a :class:`~autopar.runtime.job.Job`.

Modules, in the order ``parallelize`` applies them: ``mesh`` (validate degrees, build the
(pp, dp, tp) DeviceMesh), ``pipeline`` (cut to this rank's stages, schedules),
``layouts`` and ``tensor_parallel`` (+ ``hf`` for transformers' Conv1D), ``recompute``,
``data_parallel`` (DDP / replicate / FSDP2, mixed precision), ``init`` (meta-device
models), ``tied`` (weights shared across stages), ``optimizer`` (ZeRO-1), ``grad_norm``,
``checkpoint``, ``metrics``, ``job``; ``launch`` and ``dry_run`` for the command line;
``spmd`` runs a function on local processes for tests and benchmarks.
"""
