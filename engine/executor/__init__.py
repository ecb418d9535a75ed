"""Executors: what runs the steps the engine core schedules (in this process, or across
pipeline stages).

`base.py` is the interface the core submits microbatches to and the in-process executor
over the core's `ModelRunner`. With `pipeline_parallel_size` P > 1 the layers are split
over P worker processes (`partition.py`), each running its stage (`stage_runner.py`) and
passing hidden states to the next by point-to-point sends (`p2p.py`); `PipelineExecutor`
(`pipeline.py`) starts them, hands them every microbatch and returns the last stage's
sampled tokens as futures. With `tensor_parallel_size` T > 1 each stage is T workers,
each holding its shard of the stage's layers. `simulated.py` is a pipeline simulated in time, for the
microbatch loop's tests and benchmark.
"""
