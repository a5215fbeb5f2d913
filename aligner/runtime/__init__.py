"""Process-level concerns: device detection, CPU shims, distributed init, seeding, optional deps."""
