"""The pipeline's one error type."""


class DataError(ValueError):
    """Bad data or a data location that does not work: one line naming the file, key or split."""
