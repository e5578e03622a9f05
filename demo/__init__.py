"""The local demo: the whole mesh on one machine, each step explained (`python -m demo`)."""
