"""Where weights, optimizer state and activations live: precision and loss scaling, sharded and host
optimizer versions, swapping, the memory probe. Imports pipeline, config and errors.
"""
