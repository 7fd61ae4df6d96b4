"""Search over planners: ``auto`` (simulate, measure the best for real, calibrate),
``calibration`` (measured/simulated corrections per plan family) and ``compare`` (every
planner's plan side by side)."""
