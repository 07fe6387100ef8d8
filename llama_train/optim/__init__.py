"""The optimizers, one record each (spec.py; registry.py lists them), and the LR schedules (cosine, WSD)."""
