"""The reference model's shape as a debug model, written as a remote-code architecture.

`configuration_refmoe.py` and `modeling_refmoe.py` are copied into the
checkpoint `build.py` writes and are loaded from there (transformers has no
such class); `mxfp4.py` stores its routed experts in the MXFP4 layout.
"""
