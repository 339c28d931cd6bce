"""Blocks shared by the model families: activations, attention, the post-LN encoder scaffold."""
