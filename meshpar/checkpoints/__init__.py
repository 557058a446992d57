"""Checkpoints: orbax saves verified on restore, a run's folders, what ``--resume`` may change,
and a fresh run's parameters from another run or a Hugging Face folder."""
