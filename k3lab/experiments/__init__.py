"""Experiments built on the model layers and the trainer (they sit above ``k3lab.train``)."""
