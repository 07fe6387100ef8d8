"""What a strategy costs before it runs: memory per rank, bytes communicated, the planner's ranking."""
