"""Test and demo inputs: tiny models, the demo base and data, releases in their real
layouts, the reference model. Found from a checkout; `pip install .` leaves it out."""
