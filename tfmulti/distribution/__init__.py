"""Distribution: one start-up, devices and strategies, several workers and Slurm's, storage,
the allocator, GPU libraries."""
