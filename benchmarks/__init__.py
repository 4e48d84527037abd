"""Developer micro-benchmarks that import models/ directly and print figures (never assert)."""
