"""bcd command line: the supervisor (`bcd up`), the embedded node bus and operator commands."""
