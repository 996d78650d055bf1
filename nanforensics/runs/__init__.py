"""The run format: the recorder that writes a run directory, and the readers of its manifest, step log, batches
and checkpoints."""
