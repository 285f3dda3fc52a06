"""Profiler, topology, cost model and planner: turn a model and a machine into a plan (data) the runtime reads.

``profile`` measures each layer's time and memory (or estimates them analytically), ``topology``
describes the devices and their links, ``cost`` models a stage's memory and time and simulates
the schedule, and ``planner`` searches depth x replicas, microbatch size, recomputation and
swapping with exact stage boundaries, returning ``Plan``s that are saved as YAML. ``auto`` builds
the planner's request from a run's Config and applies a plan to it. A run gets its stages from
``python -m partitioner plan`` (a plan file, ``partition=file``), from the planner at launch
(``partition=auto``), or from ``pipeline.balance`` / an even split (``partition=manual``, the
default). This package never imports ``torch.distributed``.
"""
