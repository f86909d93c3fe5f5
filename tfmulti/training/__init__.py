"""Training: data, models, the engine, the report and the run directory."""
