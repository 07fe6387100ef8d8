"""What a run reports: metrics.jsonl, step timing, report writers, goodput, profiles."""
