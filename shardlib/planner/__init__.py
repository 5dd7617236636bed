"""Layer 3, the planner: model + mesh + policies -> ``Plan`` (pure data, testable without
processes): per-parameter layouts, units and buckets, memory and traffic per rank."""
