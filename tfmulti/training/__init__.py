"""Training: the engine and its loop, the optimizer, your compiled loss and optimizer, the
checkpoint, evaluation, the report and the export."""
