"""Profiler, topology, cost model and planner: produce plans (data) that the runtime reads.

The runtime currently takes stage boundaries from ``pipeline.balance`` (or an even split);
the automatic planner lands with its own issue and will write the same ``balance`` lists.
This package never imports the runtime's distributed code.
"""
