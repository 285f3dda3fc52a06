"""One rank's run: the checks before it, its plan, the stage worker, evaluation, preemption and the runner.
Imports every layer below it (memory, models, io, pipeline, data, config) and partitioner's plans.
"""
