"""Ready-made training recipes built from the library's public pieces."""
