"""The chaos suite: a replicated mesh under steady load while faults are applied and healed in turn."""
