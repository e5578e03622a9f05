"""What every Global Router service shares: bootstrap, logging, clock, validation, block hashing."""
