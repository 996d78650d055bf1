"""Callbacks for the loops people train with: PyTorch Lightning (``nanforensics[lightning]``) and the Hugging
Face ``Trainer`` (``nanforensics[hf]``). Each is its own module, imported only when asked for, so the
core never imports either library. ``NonFiniteLoss`` is what both raise, by default, at a non-finite loss."""

from ._watch import NonFiniteLoss

__all__ = ["NonFiniteLoss"]
