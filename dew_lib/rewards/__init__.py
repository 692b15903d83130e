"""Verifiable rewards with the `reward(data_source, completion, ground_truth, extra_info)` signature."""
