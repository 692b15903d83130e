"""Prefect tasks: thin, retriable steps that call dew_lib and record to the run store.

Each task returns small manifests (paths and numbers), never arrays, because Prefect keeps task
results. The flows in flows/ sequence these tasks; dew_lib knows nothing of Prefect.
"""
