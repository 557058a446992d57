"""Configuration: experiment YAML and ``section.key=value`` overrides → frozen dataclasses,
every check that needs no device, and the one-line errors a command reports."""
