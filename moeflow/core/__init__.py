"""The bottom layer: errors, config, devices, hardware specs, storage, tracking."""
