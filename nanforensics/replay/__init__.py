"""Replay: the recorded run's model rebuilt at a checkpoint and stepped through its logged batches, every stage
of every step checked (``engine``), with the session, monitor, mixed-precision control loop, spread map,
what-if replays and repair built on it."""
