"""Distribution: devices, workers, processes, storage, the allocator."""
