"""Executors: what runs the steps the engine core schedules (in this process, or across
pipeline stages)."""
