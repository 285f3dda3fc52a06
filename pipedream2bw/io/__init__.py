"""What a run reads and writes: checkpoints, atomic files, tracking (metrics, W&B), the timeline.
Imports config and errors only.
"""
