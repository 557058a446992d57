"""A model family defined outside meshpar: see README.md here."""
