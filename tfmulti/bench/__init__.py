"""Performance: the step model, measuring here, advice."""
