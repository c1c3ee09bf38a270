"""Planner: balance a model's blocks over stages and advise a schedule from profiled costs."""
