"""The planner's memory model: per-device bytes of a config's step by category, from abstract shapes."""
