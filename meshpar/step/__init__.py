"""Building a step: a config → its mesh, layout, the train state's plan, the jitted train and
eval steps, their abstract arguments and the programs compiled from them; the run's inputs and
throughput figures. Below the planner (which judges what is built here) and the run (which
executes it)."""
