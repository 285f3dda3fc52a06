"""The pipeline's mechanics: the schedule as data, weight versions, step agreement, the wire (p2p,
collectives, stage boundaries), tied weights and the rank layout. Imports config and errors only.
"""
