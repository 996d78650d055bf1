"""Callbacks for the loops people train with: PyTorch Lightning (``nanforensics[lightning]``) and the Hugging
Face ``Trainer`` (``nanforensics[hf]``). Each is its own module, imported only when asked for, so the
core never imports either library."""
