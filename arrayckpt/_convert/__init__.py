"""Converters between arrayckpt and torch.save files, Hugging Face safetensors, PyTorch DCP and Megatron-Core
``torch_dist`` checkpoints, and from DeepSpeed ZeRO checkpoints (read only), streaming one tensor at a time:
``dispatch.py`` chooses, ``common.py`` holds what they share, one module per format.
"""
