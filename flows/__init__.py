"""Prefect flows: one per stage, and the pipeline that chains them. Each reads as a list of steps."""
