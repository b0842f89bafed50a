"""moeflow: adapt, LoRA-fine-tune and serve mixture-of-experts models on Ray."""

__version__ = "0.1.0"
