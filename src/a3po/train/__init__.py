"""Training: the step loop and the run it belongs to."""
