"""One training run: the train and evaluate entry points, the loop, its readers, metrics and run directory."""
