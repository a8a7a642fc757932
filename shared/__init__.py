"""bcd code shared by every service: wire schemas, subjects, signing, the bus runtime."""
