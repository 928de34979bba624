"""The torch layer: what arrayckpt needs to know about torch — the torch side of the dtype table, host views
of tensors, shards (DTensor and explicit), walking nested training state into named leaves, collectives, and
read-once loading over a process group. Nothing below this layer imports torch.
"""
