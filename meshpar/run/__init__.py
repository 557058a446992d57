"""The run: a config built into its parts (mesh, layout, state plan, jitted steps), the train
loop, its inputs and outputs, ahead-of-time compilation, and generation."""
