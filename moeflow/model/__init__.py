"""What a model is, from transformers' module tree, and how it is loaded and run."""
