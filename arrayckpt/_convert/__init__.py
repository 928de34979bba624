"""Converters between arrayckpt and torch.save files, Hugging Face safetensors, PyTorch DCP and Megatron
(``torch_dist`` and ``fsdp_dtensor``) checkpoints, and from DeepSpeed ZeRO checkpoints (read only), streaming one
tensor at a time: ``dispatch.py`` chooses, ``common.py`` holds what they share, ``switch.py`` puts an export in place
(written aside, then switched in), one module per format: ``torch_save.py``,
``safetensors.py``, ``dcp.py`` (with ``dcp_payload.py``: a DCP chunk read into its place), ``megatron.py``
(``torch_dist``; ``megatron_fsdp.py``: Megatron-LM's ``fsdp_dtensor``, DCP underneath),
``deepspeed.py`` (ZeRO in; ``deepspeed_files.py`` finds its files without running its code),
``deepspeed_universal.py`` and ``deepspeed_universal_read.py`` (Universal Checkpoint out and in, with
``universal_plan.py``: which tensors under which names), ``hf.py`` (a Hugging Face model directory; ``hf_ties.py``:
the tied names it leaves out), ``peft.py`` (a PEFT LoRA adapter, out and in), ``torch_checkpointing.py`` (PyTorch's
``torch_checkpointing`` directories, out and in, with ``torch_checkpointing_layout.py``: which rank's file holds
which piece of each tensor). ``whatis.py`` says what a path holds
when it is not an arrayckpt checkpoint.
"""
