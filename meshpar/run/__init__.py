"""Running an experiment: a built step given data and state (fresh, from ``checkpoint.init_from``,
resumed, or imported from Hugging Face), the train loop, its metrics and profiles, and
generation. Above the planner, whose verdict it obeys."""
