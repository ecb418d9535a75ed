"""Executors: what runs the model for the engine core.

With one pipeline stage the core drives its in-process `ModelRunner` directly. With
`pipeline_parallel_size` P > 1 the layers are split over P worker processes
(`partition.py`), each running its stage (`stage_runner.py`) and passing hidden states to
the next by point-to-point sends (`p2p.py`); `PipelineExecutor` (`pipeline.py`) starts them,
hands them every step and returns the last stage's sampled tokens as futures, so the core
can keep several microbatches in flight.
"""
