"""The optimizers and LR schedules (AdamW, Muon + AdamW, cosine, WSD)."""
