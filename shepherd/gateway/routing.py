"""Re-export: the routing policies live in the shepherd.routing package."""
from shepherd.routing import *  # noqa: F401,F403
from shepherd.routing import __all__  # noqa: F401
