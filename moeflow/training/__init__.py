"""LoRA fine-tuning of MoE models: data, LoRA targets, step functions, routing
watch, checkpoint state, and the Ray Train worker loop + driver (trainer.py, with its
MLflow logging in tracker.py and its reported checkpoints in reporter.py)."""
