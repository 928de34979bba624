"""Converters between arrayckpt and torch.save files, Hugging Face safetensors and PyTorch DCP, and from DeepSpeed
ZeRO and Megatron-Core ``torch_dist`` checkpoints (read only), streaming one tensor at a time: ``dispatch.py``
chooses, ``common.py`` holds what they share, one module per format.
"""
