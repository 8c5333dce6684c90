"""The simulated executor lives with the other executors in shepherd.engine; this name stays for old imports."""
from shepherd.engine.sim_executor import SimExecutor, affine_step_time  # noqa: F401
