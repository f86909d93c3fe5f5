"""The book's lessons apart from the engine: data parallelism from scratch."""
