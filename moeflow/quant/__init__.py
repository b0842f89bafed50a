"""Precision calibration: quantise a checkpoint streaming (compressed-tensors format),
compare two checkpoints layer by layer on a golden set, and derive a precision plan."""
