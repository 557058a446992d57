"""Examples that use meshpar from outside it (``model.name: examples.<module>:ATTRIBUTE``)."""
