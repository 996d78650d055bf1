"""Checkpoints in every format scan and bisect read, each yielding its tensors one at a time.

Formats: our run directories (``nanforensics.run/1``) and their checkpoint folders; plain
PyTorch ``.pt``/``.pth`` pickles (``weights_only`` loading only); single ``.safetensors`` files;
Hugging Face folders (sharded with ``*.index.json``, or ``model.safetensors``, with the Trainer's
``optimizer.pt``); ``torch.distributed.checkpoint`` folders (FSDP's sharded format, ``.metadata``).
"""

from .discover import Collection, discover, open_checkpoint
from .entries import MODEL, OPTIMIZER, TensorInfo
from .source import CheckpointSource, TensorStream

__all__ = ["MODEL", "OPTIMIZER", "CheckpointSource", "Collection", "TensorInfo", "TensorStream", "discover",
           "open_checkpoint"]
