"""Checkpoints without a replay: scan one for non-finite values and headroom (``scan``), bisect many for the
first poisoned one (``bisect``)."""
