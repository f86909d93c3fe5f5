"""What a run is: its settings, flags, batch sizes and learning-rate rule."""
